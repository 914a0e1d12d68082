"""`HttpControl`: the `ControlClient` of weight_sync.py for one OpenAI-compatible server, over an aiohttp session.

Job: one control call (``/pause``, ``/collective_rpc``, ``/resume``) under its deadline, every failure
turned into a `WeightSyncStepError` that says whether the server looks down (`unreachable`: refused,
reset, or a call that does no work left unanswered) or answered with an error (`status`).
Invariant: /pause and /resume are bounded like a health probe (`quick_s`), whatever the caller allows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp

from asyncgrpo.generation.http_client import server_message
from asyncgrpo.generation.weight_sync import WeightSyncStepError

QUICK_CONTROL = ("/pause", "/resume")  # control calls that do no work: bounded like a health probe


class HttpControl:
    """A `ControlClient` for one server, over the generator's session."""

    def __init__(self, session: aiohttp.ClientSession, url: str, quick_s: float) -> None:
        self._session = session
        self.url = url
        self._quick_s = quick_s

    async def post(self, path: str, *, json_body: Any = None, params: Mapping[str, str] | None = None,
                   timeout_s: float) -> Any:
        target = f"{self.url}{path}"
        bound = "generation.weight_sync_timeout_s"
        if path in QUICK_CONTROL and timeout_s > self._quick_s:  # a server that takes longer is not answering
            timeout_s, bound = self._quick_s, "the health probe's timeout, from generation.health_probe_interval_s"
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.post(target, json=json_body, params=params) as resp:
                    status, text = resp.status, await resp.text()
        except aiohttp.ClientConnectionError as exc:  # before TimeoutError: aiohttp's connect timeout is both
            raise WeightSyncStepError(f"POST {target} failed: {type(exc).__name__}: {exc}", unreachable=True) from exc
        except TimeoutError:
            raise WeightSyncStepError(f"POST {target} got no answer within {timeout_s:g} s ({bound})",
                                      unreachable=path in QUICK_CONTROL) from None
        except aiohttp.ClientError as exc:
            raise WeightSyncStepError(f"POST {target} failed: {type(exc).__name__}: {exc}") from exc
        if not 200 <= status < 300:
            hint = ""
            if status == 404 and path in ("/pause", "/resume", "/collective_rpc"):
                hint = " (a vLLM server needs VLLM_SERVER_DEV_MODE=1 for this endpoint)"
            raise WeightSyncStepError(f"POST {target} answered HTTP {status}: {server_message(text)}{hint}", status=status)
        return text
