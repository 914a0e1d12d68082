"""The commands: what a user runs (`asyncgrpo train|simulate|check|plot|serve|convert-trl`), on the top floor.

Job: turn a command line into a run and its outcome into an exit code. `cli.py` parses arguments,
the other modules are one command each (`check`, `plot` with `plot_timeline`, `trl_convert`) or a
command's records (`run_files`). Nothing below this package imports it (tests/unit/test_layers.py).
"""
