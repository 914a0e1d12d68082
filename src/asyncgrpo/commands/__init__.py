"""The commands: what a user runs (`asyncgrpo train|simulate|check|plot|serve|convert-trl`), one module each.

Job: turn a command line into a run and its outcome into an exit code. `cli.py` parses arguments;
`train.py` (its summary in `train_summary.py`, its records in `run_files.py`), `simulate.py` (with
`sim_metrics.py` and the virtual-time loop `vtime.py`), `check.py`, `plot.py` (with
`plot_timeline.py`) and `serve.py` are the commands; `run_training.py` runs a training for the CLI
and the Python API, with what only a command's run needs: SIGINT/SIGTERM (`signals.py`), the
blocked-loop watchdog (`watchdog.py`) and GC pauses kept off the loop (`gc_pauses.py`). Only the
Python API (api.py) imports this package (tests/unit/test_layers.py).
"""
