"""Wiring a run: the one place where `train`, `simulate`, the benchmarks and the tests build a pipeline's parts.

- `prompts.py`: the run's prompts (a training run's tokenized, with its held-out eval prompts; the simulator's not).
- `backends.py`: a training run's real backends: the generator (in-process engine, Ray actors or HTTP servers)
  and the data-parallel ranks on Ray.
- `run.py`: `wire_run`, the parts every run is made of, built in one order from the recipe and the backends
  (real or scripted): reward scorer, ledger, timeline, collector.
- `collector.py`: the collector of a recipe (prompt source, scorer, sampling parameters), for `wire_run` and for
  the tests and benchmarks that drive a collector alone.

Invariant: every part is handed what it needs to its constructor; nothing is set on a built part afterwards (the one
exception is named where it happens: the reward scorer's trainer_state, which needs the collector the scorer is
given to).
"""
