"""The driver's resident memory once a run is prepared (`TrainingRun.prepare`: model, data, generator, resume), issue #25.

Prints VmRSS and VmHWM (peak) from /proc/self/status above what the imports of torch and transformers take, and which
trainer the driver holds. With `runtime=ray train.world_size=2` no Ray is started: the ranks are built, not placed, so
the figure is what the driver alone holds.

    PYTHONPATH=src python bench/driver_memory.py builtin:smollm2-135m-instruct runtime=ray train.world_size=2 \\
        train.loss.kl_coef=0.05 model.dtype=bfloat16
"""

from __future__ import annotations

import gc
import sys
import tempfile

import torch  # noqa: F401 - in the baseline: every run imports it
import transformers  # noqa: F401

from asyncgrpo.commands.train import Stop, TrainingRun
from asyncgrpo.config import load_config
from asyncgrpo.rundir import claim
from asyncgrpo.training.resume import plan_resume


def status_mib(key: str) -> float:
    with open("/proc/self/status") as handle:
        return int(next(line for line in handle if line.startswith(key)).split()[1]) / 1024


def main() -> None:
    model, overrides = sys.argv[1], sys.argv[2:]
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [f"model.path={model}", f"run.output_dir={out}", "logging.progress=false", "eval.every_steps=0", *overrides])
        base = status_mib("VmRSS")
        with claim(cfg.run.directory) as run_dir:
            run = TrainingRun.prepare(cfg, plan_resume(cfg), run_dir, Stop())
            gc.collect()
            print(f"{model} {' '.join(overrides)}: driver RSS {status_mib('VmRSS') - base:.0f} MiB above the imports "
                  f"(peak {status_mib('VmHWM') - base:.0f} MiB); trainer: {type(run.trainer).__name__}")


if __name__ == "__main__":
    main()
