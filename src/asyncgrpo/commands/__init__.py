"""The commands: what `asyncgrpo train`, `asyncgrpo simulate` (and the other subcommands) run, one module each."""
