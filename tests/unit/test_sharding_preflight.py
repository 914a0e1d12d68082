"""`train.sharding: fsdp` on a torch without what training/sharding.py needs: a ConfigError before any rank starts."""

from __future__ import annotations

import pytest
import torch.distributed.fsdp as fsdp

from asyncgrpo.errors import ConfigError
from asyncgrpo.training.sharding import check_torch_supports_fsdp


def test_this_torch_supports_fsdp_sharding():
    check_torch_supports_fsdp()


def test_a_torch_without_the_sum_reduction_is_a_config_error_naming_the_key_and_the_fix(monkeypatch):
    class OldFSDPModule:  # FSDP2 before torch 2.8: no plain-SUM reduction
        pass

    monkeypatch.setattr(fsdp, "FSDPModule", OldFSDPModule)
    with pytest.raises(ConfigError) as info:
        check_torch_supports_fsdp()
    message = str(info.value)
    assert "train.sharding = fsdp" in message and "set_force_sum_reduction_for_comms" in message
    assert "Fix: install torch >= 2.8, or set train.sharding: ddp" in message
