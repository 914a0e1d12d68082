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
