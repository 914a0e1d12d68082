"""TRL's loss family, the off-policy corrections and the loss plug-in, one job per module (training/loss.py composes them).

- `objectives`: the per-token policy term of each built-in `train.loss.type` from the policy ratio.
- `corrections`: the detached off-policy weight: the staleness correction (`is_cap`) and TRL's mismatch modes.
- `aggregation`: how each type turns per-token losses into one update's loss, and the update's normaliser.
- `plugin`: `train.loss.type: module:function`, its `LossBatch` argument and the checks on what it returns.
"""
