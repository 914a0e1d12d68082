"""The console during training: a progress bar on stderr, or a log line every tenth of the run."""

from __future__ import annotations

import logging
import sys
from typing import Any

from asyncgrpo.config import Config

log = logging.getLogger("asyncgrpo")


class Progress:
    """A progress bar on stderr (step, reward, ETA), or a line every 10 steps when `logging.progress` is off."""

    def __init__(self, cfg: Config, start_step: int) -> None:
        self.every = max(1, cfg.train.max_steps // 10)
        self.bar = None
        if cfg.logging.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.max_steps, initial=start_step, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)

    def update(self, values: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{values['reward/mean']:.3f}", stale=values["staleness/max"], refresh=False)
            self.bar.update(1)
        elif (values["step"] + 1) % self.every == 0:
            log.info("step %d  reward %.3f  loss %.4f", values["step"] + 1, values["reward/mean"], values["loss"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
