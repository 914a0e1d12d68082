"""`NoSignalWatch`: notice when most groups teach nothing, and say so once.

A group whose rewards are all equal has all advantages 0: it costs generation and a training
step's compute and moves no weight. With `rollout.filter_zero_variance` off such groups are
trained anyway; if they are most of the recent ones, the run is learning (almost) nothing,
usually because the task is too hard or too easy for the model, or the reward is constant.

Pure policy, no I/O: `observe` is told, for each group judged, whether its rewards were all
equal, and returns the warning to log the first time more than half of the last `window`
judged groups were (only once `window` groups have been judged); never again afterwards.
"""

from __future__ import annotations

from collections import deque


class NoSignalWatch:
    def __init__(self, window: int) -> None:
        self.window = window
        self._recent: deque[bool] = deque(maxlen=window)
        self.warned = False

    def observe(self, equal_rewards: bool) -> str | None:
        self._recent.append(equal_rewards)
        if self.warned or len(self._recent) < self.window:
            return None
        flat = sum(self._recent)
        if flat * 2 <= self.window:
            return None
        self.warned = True
        return (
            f"warning: {flat} of the last {self.window} groups (rollout.drop_window) had equal rewards for every "
            f"completion ({flat / self.window:.0%}): their advantages are 0, so they cost compute and teach nothing. "
            f"Fix: make the task fit the model (a reward that some but not all completions of a prompt earn: easier "
            f"prompts, partial credit, a format reward), raise rollout.group_size, or set "
            f"rollout.filter_zero_variance: true to skip such groups."
        )
