"""asyncgrpo: asynchronous GRPO that never hangs, never loses a prompt and never trains past its staleness bound."""

__version__ = "0.1.0"
