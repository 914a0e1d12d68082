"""Reward functions that misbehave, for the tests that check a run survives them (by name: module:function)."""

from __future__ import annotations

import time


async def sleeps_on_the_loop(prompts, completions, **kwargs):
    """An async reward that calls time.sleep: the event loop running it (the scorer's reward loop) stops turning for an hour."""
    time.sleep(3600)
    return [0.0 for _ in completions]


def exits(prompts, completions, **kwargs):
    """A sync reward that calls sys.exit: a reward error, never the end of the trainer."""
    raise SystemExit(0)


async def interrupts(prompts, completions, **kwargs):
    """An async reward that raises KeyboardInterrupt on the event loop."""
    raise KeyboardInterrupt
