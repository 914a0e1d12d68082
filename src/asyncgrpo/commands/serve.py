"""The `asyncgrpo serve MODEL` process: load the model, serve `serve.create_app` over it until SIGINT/SIGTERM.

Job: build the engine and the application (generation/serve.py), bind, announce the address and the request
bounds on stderr, and on a stop close the connections (cancelling their handlers, so their engine
requests), then the engine, then the prompt tokeniser's thread; bounded by aiohttp's shutdown timeout.
`serve_cli` maps failures to exit codes: 3 for a model that cannot load, 1 for an address that cannot be bound.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from asyncgrpo.generation.serve import RELOAD_TIMEOUT_S, STATE, create_app


async def run_server(model: str, *, host: str = "127.0.0.1", port: int = 8000, max_batch_size: int = 64,
                     served_model_name: str | None = None, dtype: str = "float32", seed: int = 0,
                     max_prompt_chars: int | None = None, reload_timeout_s: float = RELOAD_TIMEOUT_S,
                     stop: asyncio.Future | None = None) -> None:
    """Load `model` (anything `model.path` accepts), serve it until `stop` resolves (default: SIGINT/SIGTERM)."""
    from asyncgrpo.generation.local import LocalEngine
    from asyncgrpo.models.loading import load_model_and_tokenizer

    net, tokenizer = load_model_and_tokenizer(model, dtype, seed)
    max_model_len = int(getattr(net.config, "max_position_embeddings", 0) or 0) or 2048
    name = served_model_name or model
    engine = LocalEngine(net, tokenizer, name=f"serve:{name}", max_batch_size=max_batch_size)
    model_dir = model if Path(model).is_dir() else None

    def engine_factory(version: int) -> LocalEngine:  # the failed engine's thread has exited: the model is free
        return LocalEngine(net, tokenizer, name=f"serve:{name}", max_batch_size=max_batch_size, version=version)

    app = create_app(engine, tokenizer, model_name=name, max_model_len=max_model_len,
                     vocab_size=net.get_input_embeddings().num_embeddings, model_dir=model_dir,
                     engine_factory=engine_factory, max_prompt_chars=max_prompt_chars, reload_timeout_s=reload_timeout_s)
    loop = asyncio.get_running_loop()
    own_signals = stop is None
    if stop is None:
        stop = loop.create_future()

        def request_stop() -> None:
            if not stop.done():
                stop.set_result(None)

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, request_stop)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0, access_log=None)
    await engine.start()
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, port, shutdown_timeout=2.0)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        limits = app[STATE]
        print(f"asyncgrpo serve: serving {name!r} (max_model_len {max_model_len}, prompts of at most "
              f"{limits.max_prompt_chars} characters, bodies of at most {limits.max_body_bytes} bytes) on "
              f"http://{host}:{bound}", file=sys.stderr, flush=True)
        await stop
    finally:
        await runner.cleanup()  # closes connections: their handlers are cancelled, so are their engine requests
        await app[STATE].engine.aclose()  # the engine now serving (a reload may have replaced a failed one)
        app[STATE].prompt_threads.close()
        if own_signals:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)


def serve_cli(args: Any) -> int:
    """The `asyncgrpo serve` command (arguments parsed by cli.py)."""
    from asyncgrpo.errors import ConfigError

    try:
        asyncio.run(run_server(args.model, host=args.host, port=args.port, max_batch_size=args.max_batch_size,
                               served_model_name=args.served_model_name, dtype=args.dtype, seed=args.seed,
                               max_prompt_chars=args.max_prompt_chars, reload_timeout_s=args.reload_timeout_s))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 3
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0
