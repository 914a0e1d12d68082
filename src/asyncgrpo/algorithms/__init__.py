"""Training algorithms behind one protocol (base.py): GRPO (grpo.py) and on-policy distillation (distill.py).

names.py is the registry's table (each name, its implementation's path, what the config needs of it) and
registry.py builds the recipe's `algorithm:` from it; they are the only places that read the name. Adding an
algorithm is one module here and one line in names.py (DESIGN.md §3 "Algorithms").

Invariant: this file imports nothing, so the config can read names.py without importing the algorithms.
"""
