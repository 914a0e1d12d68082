"""The collector of a recipe: its prompt source, reward scorer and sampling parameters (wiring/run.py calls it
for `train` and `simulate`; tests and benchmarks that drive a collector alone call it directly).

What differs between callers is passed in: the prompts (tokenized or not), the generator, the stop
tokens of the tokenizer, a resumed run's ledger and books, and (for tests and benchmarks) a scorer
of their own. Every part is given to the collector's constructor; nothing is set on it afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.config import Config, EnvConfig
from asyncgrpo.data.source import PromptSource
from asyncgrpo.environments.conversation import CharCodec, Codec, TokenizerCodec
from asyncgrpo.environments.protocol import EnvironmentHost
from asyncgrpo.generation.base import Generator
from asyncgrpo.rewards.scoring import Isolation, RewardScorer
from asyncgrpo.rollout.accounting import Accounting
from asyncgrpo.rollout.collector import Collector, ScorerLike
from asyncgrpo.rollout.events import RolloutObserver
from asyncgrpo.rollout.ledger import PromptLedger
from asyncgrpo.types import Prompt, SamplingParams


def sampling_params(cfg: Config, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """Training-time sampling: the recipe's generation settings; the tokenizer's EOS is among `stop_token_ids`."""
    return SamplingParams(
        max_new_tokens=cfg.generation.max_new_tokens,
        temperature=cfg.generation.temperature,
        top_p=cfg.generation.top_p,
        stop_token_ids=tuple(dict.fromkeys([*cfg.generation.stop_token_ids, *stop_token_ids])),
        top_k=cfg.generation.top_k,
        min_p=cfg.generation.min_p,
        repetition_penalty=cfg.generation.repetition_penalty,
    )


def episode_codec(cfg: Config, tokenizer: Any) -> Codec | None:
    """How episodes are tokenized (environments/conversation.py), for the collector and evaluation alike: with `tokenizer`'s
    chat template, or without a tokenizer (the simulator) one id per character; None without an `env:` section."""
    if cfg.env is None:
        return None
    return TokenizerCodec(tokenizer) if tokenizer is not None else CharCodec()


def build_collector(
    cfg: Config,
    prompts: list[Prompt],
    generator: Generator,
    *,
    stop_token_ids: tuple[int, ...] = (),
    scorer: ScorerLike | None = None,
    isolation: Isolation | None = None,
    ledger: PromptLedger | None = None,
    start_step: int = 0,
    resumed: dict[str, Any] | None = None,
    observer: RolloutObserver | None = None,
    tokenizer: Any = None,
    host_factory: Callable[[EnvConfig], EnvironmentHost] | None = None,
) -> Collector:
    """The collector over `prompts` on `generator`, with the recipe's source order and reward functions.

    `scorer`: the recipe's reward functions when None; or the algorithm's own (algorithms/: distillation's teacher).
    `isolation` overrides `reward.isolation` (simulations score inline, on virtual time); `ledger`
    and `resumed` (a checkpoint's accounting and counters) continue a run from a checkpoint;
    `observer` is told each rollout's and take's life (rollout/events.py; the run's timeline). With an
    `env:` section, episodes are tokenized with `tokenizer`'s chat template, or without one (the
    simulator) one id per character (environments/conversation.py), each episode's host made by
    `host_factory` (default: environments/hosts.py's, from `env.factory`)."""
    source = PromptSource(
        prompts,
        num_epochs=cfg.data.num_epochs,
        shuffle=cfg.data.shuffle,
        seed=cfg.run.seed,
        done=ledger.done_by_epoch() if ledger is not None else None,
    )
    if scorer is None:
        scorer = RewardScorer.from_config(cfg.reward, isolation=isolation)
    collector = Collector(
        cfg, source=source, generator=generator, scorer=scorer, algorithm=algorithm_for(cfg), sampling=sampling_params(cfg, stop_token_ids),
        start_step=start_step, ledger=ledger, observer=observer,
        accounting=Accounting.resumed(resumed["accounting"]) if resumed else None, counters=resumed["counters"] if resumed else None,
        codec=episode_codec(cfg, tokenizer),
        **({"host_factory": host_factory} if host_factory is not None else {}),
    )
    return collector
