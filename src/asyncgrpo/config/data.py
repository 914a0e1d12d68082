"""The data: section: where the prompts come from and how they are read."""

from __future__ import annotations

from pydantic import Field

from asyncgrpo.config.section import Section


class DataConfig(Section):
    """The training prompts: their source, the column that holds them, epochs, order and length limit."""

    source: str = Field("builtin:repeat_letter", description="builtin:<task>, a .jsonl or .parquet file, or a saved Hugging Face dataset directory.")
    prompt_key: str = Field("prompt", min_length=1, description="Column holding the prompt (text, or a list of chat messages).")
    num_epochs: int = Field(1, ge=1, description="Passes over the data; each epoch reshuffles.")
    shuffle: bool = Field(True, description="Shuffle the prompts (seeded by run.seed), again each epoch.")
    max_prompt_tokens: int = Field(256, ge=1, description="Prompts longer than this are dropped at load, with a count.")
    drop_last: bool = Field(False, description="Skip the last, partial batch at end of data instead of training it as a smaller batch.")
    builtin_size: int = Field(
        2048, ge=1, le=1_000_000,
        description="Number of prompts a builtin:<task> source generates; at most 1,000,000, since every prompt is built in memory "
        "before the first step (about 1 GB at the bound).",
    )

