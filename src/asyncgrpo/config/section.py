"""What every section of the recipe shares: the base model and the device type.

Invariants: a section forbids unknown keys, is frozen once validated, validates its defaults and refuses
NaN and infinity, so every number the run reads has been checked against its bounds.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


def check_device(device: str) -> str:
    if device in ("auto", "cpu", "cuda", "mps") or (device.startswith("cuda:") and device[5:].isdigit()):
        return device
    raise ValueError(f"{device!r} is not a device. Fix: use auto (the accelerator when present, else cpu), cpu, cuda, cuda:N or mps")


Device = Annotated[str, AfterValidator(check_device)]
