"""`asyncgrpo tune RUN_DIR`: calibrate the simulator from a real run, check it replays the run, then sweep for a better config.

records.py reads a run directory; fit.py fits the simulator's models (pure); observe.py measures a run
and a simulation the same way; calibrate.py writes tuned.yaml; sweep.py explores configs around the run's.
"""
