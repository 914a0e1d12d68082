"""On-policy distillation (`algorithm: distill`): the student samples, a teacher scores the sampled tokens, and
the loss lowers the per-token reverse KL from the student to the teacher.

- `judge.py` (pure): a sample and its teacher log-probs become a trainable rollout; the KL statistics.
- `simulated.py`: the teacher of `asyncgrpo simulate`, on virtual time, with latency and faults.
- `loss.py` (tensors): the per-token advantage -(log pi_gen - log pi_teacher) the GRPO loss trains on.
- `teacher.py`: the real teacher, a model on a thread it owns, fed by a bounded queue, batching samples.

Each sample is its own unit of admission, staleness, cancellation and accounting (`rollout.group_size: 1`).
algorithms/distill.py is the algorithm's implementation: it hands these pieces to the collector, the trainer
and the run through the algorithm hooks (algorithms/base.py).
"""
