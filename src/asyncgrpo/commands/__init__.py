"""The commands: what a user runs (`asyncgrpo train|simulate|check|plot|serve|convert-trl`), on the top floor.

Job: turn a command line into a run and its outcome into an exit code. `cli.py` parses arguments;
`check.py`, `plot.py` (with `plot_timeline.py`) and `serve.py` are one command each;
`run_training.py` runs a training for the CLI and the Python API, with what only a command's run
needs: its records (`run_files.py`), SIGINT/SIGTERM (`signals.py`), the blocked-loop watchdog
(`watchdog.py`), GC pauses kept off the loop (`gc_pauses.py`) and, for `simulate`, the virtual-time
loop (`vtime.py`). Only the Python API (api.py) imports this package (tests/unit/test_layers.py).
"""
