"""`run_bounded`: a test's coroutine run to completion under a deadline, so a hang fails the test (TimeoutError)
instead of waiting for pytest's timeout. Each test module binds its own default deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_bounded(coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())
