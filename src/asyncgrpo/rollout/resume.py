"""Resumable rollouts (`rollout.on_stale: resume`): the pure arithmetic of prefixes and per-token masks. No tasks, no I/O.

A rollout the next step would leave behind is interrupted, not thrown away: the tokens its attempt
had generated (read from the request's `TokenSink`) become its prefix, and a resumed request continues it
under the newest weights with the budget left (`resumed_request`). Its completion is the prefix followed
by every continuation (`join`): ids, behaviour logprobs, per-token versions and text, nothing lost or
duplicated at a seam.

The staleness bound then holds per token, not per group (`mask_stale`): when a group is buffered, and
again before a step takes it, every token of a version older than `step - K` is masked out of the loss
(it stays in the context); the group's generation version, the minimum over its unmasked tokens, is
then within the bound, so the buffer's and the take's checks hold unchanged. A group in which one rollout
would have more than `rollout.max_masked_share` of its tokens masked is stale as a whole (its prompt
handled as `requeue` does). `rollout.max_prefix_staleness` K' (explicit, at least K) is the bound of a
rollout with a resumed prefix, one whose tokens span versions (`has_resumed_prefix`: continued under newer
weights, after an interruption or in place); every other rollout keeps K, also in a group where a sibling
was resumed (`rollout_bound`).

Invariants: `join` keeps every token of its parts in order; `mask_stale` only ever adds masked tokens
(a token once masked stays masked) and reports how many it added.
"""

from __future__ import annotations

from dataclasses import replace

from asyncgrpo.types import Completion, GenerationRequest, Group, TokenSink


def partial(sink: TokenSink, dispatch_version: int) -> Completion:
    """The tokens an interrupted attempt generated, as a completion (its budget not spent: `stop` is never claimed)."""
    return Completion(token_ids=tuple(sink.token_ids), logprobs=tuple(sink.logprobs), versions=tuple(sink.versions),
                      finish_reason="length", dispatch_version=dispatch_version, text="".join(sink.text))


def join(prefix: Completion | None, continuation: Completion) -> Completion:
    """A rollout's completion: its prefix (None: it was never interrupted) followed by the continuation, whose finish
    reason and dispatch version it keeps; its text is the prefix's (the text its backend put in the sink) followed by
    the continuation's."""
    if prefix is None or not prefix.token_ids:
        return continuation
    return Completion(
        token_ids=prefix.token_ids + continuation.token_ids,
        logprobs=prefix.logprobs + continuation.logprobs,
        versions=prefix.versions + continuation.versions,
        finish_reason=continuation.finish_reason,
        dispatch_version=continuation.dispatch_version,
        text=prefix.text + continuation.text,
    )


def resumed_request(request: GenerationRequest, prefix: Completion | None, sink: TokenSink) -> GenerationRequest:
    """The request that continues `prefix` (None or empty: the rollout's first request): the prompt followed by the prefix's
    ids as context, the budget left (0 when the prefix spent it: the backend returns an empty continuation)."""
    if prefix is None or not prefix.token_ids:
        return replace(request, sink=sink)
    left = max(0, request.sampling.max_new_tokens - len(prefix.token_ids))
    return replace(request, prompt_token_ids=request.prompt_token_ids + prefix.token_ids, resumed_tokens=len(prefix.token_ids),
                   sampling=replace(request.sampling, max_new_tokens=left), sink=sink)


def has_resumed_prefix(completion: Completion) -> bool:
    """Do the completion's tokens span versions: a prefix generated under older weights, continued under newer ones?"""
    return completion.versions[:1] != completion.versions[-1:]


def rollout_bound(completion: Completion, *, bound: int, prefix_bound: int | None) -> int:
    """The staleness bound of one rollout's tokens: `prefix_bound` (`rollout.max_prefix_staleness`) if it has a resumed
    prefix and one is set, else `bound` (K)."""
    return prefix_bound if prefix_bound is not None and has_resumed_prefix(completion) else bound


def masked_share(completion: Completion, *, step: int, bound: int) -> float:
    """The share of the completion's tokens older than `step - bound` (0 for an empty completion)."""
    if not completion.versions:
        return 0.0
    return sum(v < step - bound for v in completion.versions) / len(completion.versions)


def mask_stale(group: Group, *, step: int, bound: int, prefix_bound: int | None, max_share: float) -> tuple[Group, int] | None:
    """The group with every token older than `step - ` its rollout's bound (`rollout_bound`) masked out of the loss, and how
    many tokens that masked anew; None when a rollout would have more than `max_share` of its tokens masked (the group is
    stale)."""
    rollouts, added = [], 0
    for rollout in group.rollouts:
        c = rollout.completion
        own = rollout_bound(c, bound=bound, prefix_bound=prefix_bound)
        if masked_share(c, step=step, bound=own) > max_share:
            return None
        old = c.loss_mask if c.loss_mask is not None else (True,) * len(c.token_ids)
        mask = tuple(m and v >= step - own for m, v in zip(old, c.versions))
        if mask == old:
            rollouts.append(rollout)
            continue
        added += sum(old) - sum(mask)
        rollouts.append(replace(rollout, completion=replace(c, loss_mask=mask)))
    if not added:
        return group, 0
    return replace(group, rollouts=tuple(rollouts)), added


def version_span(groups: list[Group]) -> int:
    """The widest span of policy versions among the trained (unmasked) tokens of one rollout of `groups` (0 if none)."""
    spans = [0]
    for group in groups:
        for rollout in group.rollouts:
            c = rollout.completion
            trained = [v for v, m in zip(c.versions, c.loss_mask or (True,) * len(c.versions)) if m]
            if trained:
                spans.append(max(trained) - min(trained))
    return max(spans)
