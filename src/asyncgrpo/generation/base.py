"""The `Generator` protocol: what the collector needs from a generation backend.

A generator turns one `GenerationRequest` into one `Completion`, or raises a classified
`GenerationError` (see errors.py). Backends: the in-process local engine, the scripted
backend of the simulator, and (later) OpenAI-compatible HTTP servers.

Contract:
- `generate` is cancellable: cancelling the awaiting task stops the request and frees
  what it used (the local engine drops the sequence between decoding steps; an HTTP
  backend closes the request so the server aborts it).
- `serving_version` is the policy version new requests are served at, as actually loaded.
- `load_weights(state, version)` installs new weights; requests in flight keep running,
  and their later tokens carry the new version. It returns once the new version serves.
- `aclose` releases threads and connections; it is bounded and idempotent.
- `rollout.on_stale: resume` (rollout/resume.py): a backend appends each token it generates to the
  request's `sink` (when it has one), so a cancelled (interrupted) request loses none; a resumed
  request's context ends with the rollout's own earlier tokens (`resumed_tokens`), its budget may be
  0 (answer with an empty continuation), and its completion (ids and `text`) is the continuation only; a
  backend that decodes text puts each token's text in the sink too (the HTTP backend streams it). A backend whose
  weights change between decoding steps declares `continues_in_flight = True` (the local engine): its
  rollouts are never interrupted, each token already carries its version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from asyncgrpo.types import Completion, GenerationRequest


@runtime_checkable
class Generator(Protocol):
    name: str

    @property
    def serving_version(self) -> int: ...

    async def start(self) -> None: ...

    async def generate(self, request: GenerationRequest) -> Completion: ...

    async def load_weights(self, state: Mapping[str, Any] | None, version: int) -> None: ...

    async def aclose(self) -> None: ...
