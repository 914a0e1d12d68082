"""Where a Ray generator actor's engine runs: the GPU Ray reserved for it, or the CPU, never a GPU it was not given;
an actor told to use CUDA where it sees none fails to start saying what to set."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.errors import GenerationError
from asyncgrpo.generation.ray_pool import GeneratorActor, actor_device
from asyncgrpo.models.loading import load_model_and_tokenizer


@pytest.mark.parametrize(("spec", "num_gpus", "expected"), [
    ("auto", 0, "cpu"), ("auto", 1, "cuda"), ("auto", 0.5, "cuda"), ("cpu", 1, "cpu"), ("cuda:1", 0, "cuda:1"),
])
def test_auto_means_the_reserved_gpu_and_an_explicit_device_is_kept(spec, num_gpus, expected):
    assert actor_device(spec, num_gpus) == expected


def test_the_actor_moves_its_copy_to_its_device_and_refuses_cuda_it_cannot_see():
    model, tokenizer = load_model_and_tokenizer("builtin:tiny", "float32", 0)
    actor = GeneratorActor(model, tokenizer, 0, 4, "g-0", "meta")  # meta: a device other than the copy's, on any machine
    assert actor._engine._device == torch.device("meta")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(GenerationError, match=rf"sees {visible} CUDA device.*numbered from 0.*ray.generator.num_gpus"):
        GeneratorActor(model, tokenizer, 0, 4, "g-0", f"cuda:{visible}")  # one past the last it sees
