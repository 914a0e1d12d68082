"""Training algorithms behind one protocol (base.py): GRPO (grpo.py) and on-policy distillation (distill.py).

registry.py maps the recipe's `algorithm:` to its implementation; it is the only place that reads the name.
Adding an algorithm is one module here and one line in the registry (DESIGN.md §3 "Algorithms").
"""
