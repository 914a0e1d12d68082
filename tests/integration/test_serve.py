"""`asyncgrpo serve` as a real process: vLLM's completion shapes, logprobs, errors, pause/resume, reload, disconnects.

One server (builtin:tiny saved to disk) serves the whole module; tests that change its weights
put the original ones back. Waits poll the server's /stats with a deadline.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.generation.weight_sync import write_weights
from asyncgrpo.models.saving import save_model
from asyncgrpo.models.tiny import build_tiny
from asyncgrpo.sampling import Processing, sampled_logprobs, seen_before
from tests.integration.servers import ServeProcess, http, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model(*build_tiny(0), tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    proc = ServeProcess(model_dir, tmp_path_factory.mktemp("logs"), extra=("--served-model-name", "tiny")).start()
    try:
        yield proc.wait_healthy()
    finally:
        code = proc.stop()
    assert code == 0, f"SIGTERM should stop the server cleanly, got exit code {code}:\n{proc.log()}"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return build_tiny(0)[1]


def complete(server: ServeProcess, **body):
    body.setdefault("model", "tiny")
    return http("POST", f"{server.url}/v1/completions", body)


def teacher_forced(model, prompt_ids, token_ids, temperature: float) -> torch.Tensor:
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    p = len(prompt_ids)
    return logp[p - 1 : -1].gather(1, torch.tensor(token_ids)[:, None]).squeeze(1)


def test_completion_has_vllms_shape_and_the_sampled_distributions_logprobs(server, model_dir, tokenizer):
    status, models = http("GET", f"{server.url}/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 512
    prompt = tokenizer("say c: ")["input_ids"]
    body = dict(prompt=prompt, max_tokens=16, temperature=0.7, top_p=1.0, seed=5, logprobs=0, return_token_ids=True,
                stop_token_ids=[tokenizer.eos_token_id])
    status, out = complete(server, **body)
    assert status == 200, out
    assert out["object"] == "text_completion" and out["model"] == "tiny" and out["id"]
    choice = out["choices"][0]
    ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    assert 1 <= len(ids) <= 16 and len(logprobs) == len(ids) == len(choice["logprobs"]["tokens"])
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    body_ids = ids[:-1] if choice["finish_reason"] == "stop" else ids
    assert choice["text"] == tokenizer.decode(body_ids, skip_special_tokens=True)

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    expected = teacher_forced(model, prompt, ids, temperature=0.7)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)

    # A seed reproduces the completion; a text prompt is tokenized like the ids.
    assert complete(server, **body)[1]["choices"][0]["token_ids"] == ids
    assert complete(server, **{**body, "prompt": "say c: "})[1]["choices"][0]["token_ids"] == ids
    # Without return_token_ids / logprobs, vLLM leaves them out.
    plain = complete(server, prompt=prompt, max_tokens=4, seed=1)[1]["choices"][0]
    assert "token_ids" not in plain and plain["logprobs"] is None


@pytest.mark.parametrize("knobs", [dict(top_p=0.9), dict(top_k=20), dict(min_p=0.6), dict(repetition_penalty=1.3),
                                   dict(top_p=0.8, top_k=12, min_p=0.05, repetition_penalty=1.2)], ids=str)
def test_truncated_sampling_logprobs_are_what_the_trainer_computes(server, model_dir, tokenizer, knobs):
    """The served logprobs are log q of the sampled distribution, equal to the trainer's `sampled_logprobs` of the same
    weights: the importance ratio at staleness 0 is 1 whatever the truncation."""
    prompt = tokenizer("say c: ")["input_ids"]
    status, out = complete(server, prompt=prompt, max_tokens=24, temperature=0.9, seed=3, logprobs=0,
                           return_token_ids=True, ignore_eos=True, **knobs)
    assert status == 200, out
    ids, logprobs = out["choices"][0]["token_ids"], out["choices"][0]["logprobs"]["token_logprobs"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    full = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(full).logits[:, len(prompt) - 1 : -1]
    positions = torch.arange(len(prompt) - 1, full.shape[1] - 1)
    seen = seen_before(full, torch.ones_like(full), logits.shape[-1], positions)
    expected, _ = sampled_logprobs(logits, torch.tensor([ids]), Processing(temperature=0.9, **knobs), seen=seen)
    torch.testing.assert_close(torch.tensor([logprobs]), expected, atol=1e-4, rtol=0)
    untruncated = torch.log_softmax(logits.float() / 0.9, -1).gather(-1, torch.tensor([ids])[..., None]).squeeze(-1)
    assert float((torch.tensor([logprobs]) - untruncated).abs().max()) > 1e-3  # the knobs really change the distribution


def test_errors_have_vllms_status_codes_and_wording(server):
    before = server.stats()
    cases = [
        ({"prompt": [5] * 600, "max_tokens": 4}, 400, "longer than the maximum model length"),
        ({"prompt": [5] * 500, "max_tokens": 20}, 400, "maximum context length is 512"),
        ({"prompt": [5, 6], "max_tokens": 4, "model": "not-served"}, 404, "does not exist"),
        ({"prompt": [5, 6], "max_tokens": 4, "n": 2}, 400, "n=2"),
        ({"prompt": [5, 6], "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": [], "max_tokens": 4}, 400, "empty"),
        ({"prompt": [5, 10_000], "max_tokens": 4}, 400, "out of vocabulary"),
        ({"prompt": [5, 6], "max_tokens": 4, "top_k": -3}, 400, "top_k"),
        ({"prompt": [5, 6], "max_tokens": 4, "min_p": 1.5}, 400, "min_p"),
        ({"prompt": [5, 6], "max_tokens": 4, "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"prompt": [5, 6], "max_tokens": 4, "presence_penalty": 0.5}, 422, "presence_penalty"),
        ({"prompt": [5, 6], "max_tokens": 4, "logprobs": 5}, 422, "logprobs=0"),
        ({"prompt": [5, 6], "max_tokens": 4, "frobnicate": 1}, 422, "frobnicate"),
        ({"prompt": [5, 6], "max_tokens": 4, "stream": "yes"}, 400, "stream must be a boolean"),
        ({"prompt": [5, 10_000], "max_tokens": 4, "stream": True}, 400, "out of vocabulary"),  # before any event
    ]
    for body, status, words in cases:
        got, out = complete(server, **body)
        assert got == status, (body, out)
        assert words in out["error"]["message"] and out["error"]["code"] == status, (body, out)
    got, out = http("POST", f"{server.url}/v1/completions", b"{not json")
    assert got == 400 and "not valid JSON" in out["error"]["message"]
    after = server.stats()
    assert after["requests_rejected"] - before["requests_rejected"] == len(cases) + 1
    assert after["engine"]["steps"] == before["engine"]["steps"]  # nothing reached the engine


def test_pause_keep_lets_running_requests_finish_and_holds_new_ones_until_resume(server):
    results: dict[str, tuple[int, dict]] = {}

    def send(key: str, **body) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.__setitem__(key, complete(server, **body)))
        thread.start()
        return thread

    base = server.stats()
    running = send("running", prompt=[5, 6, 7], max_tokens=60, ignore_eos=True, seed=1, return_token_ids=True)
    wait_until(lambda: server.stats()["engine"]["active"] == 1, 30, "the first request to be generating")
    assert http("POST", f"{server.url}/pause?mode=keep")[1] == {"status": "paused"}
    held = send("held", prompt=[5, 6, 7], max_tokens=4, seed=2, return_token_ids=True)
    wait_until(lambda: server.stats()["requests_waiting"] == 1, 30, "the second request to wait on the pause")
    running.join(timeout=60)
    assert results["running"][0] == 200 and len(results["running"][1]["choices"][0]["token_ids"]) == 60
    assert "held" not in results and server.stats()["paused"] is True  # still held although the engine is idle
    assert http("POST", f"{server.url}/resume")[1] == {"status": "resumed"}
    held.join(timeout=60)
    assert results["held"][0] == 200
    stats = server.stats()
    assert stats["requests_completed"] - base["requests_completed"] == 2 and stats["requests_waiting"] == 0


def test_pause_abort_ends_running_requests_with_finish_reason_abort(server):
    results: dict[str, tuple[int, dict]] = {}
    base = server.stats()
    thread = threading.Thread(target=lambda: results.__setitem__("r", complete(
        server, prompt=[5, 6, 7], max_tokens=500, ignore_eos=True, return_token_ids=True)))
    thread.start()
    try:
        wait_until(lambda: server.stats()["engine"]["active"] == 1, 30, "the request to be generating")
        assert http("POST", f"{server.url}/pause?mode=abort")[1] == {"status": "paused"}
        thread.join(timeout=30)
        status, out = results["r"]
        assert status == 200 and out["choices"][0]["finish_reason"] == "abort" and out["choices"][0]["token_ids"] == []
        stats = wait_until(lambda: (s := server.stats())["engine"]["active"] == 0 and s, 30, "the engine to drop it")
        assert stats["requests_aborted"] - base["requests_aborted"] == 1
    finally:
        http("POST", f"{server.url}/resume")


def events(server: ServeProcess, **body) -> list:
    """The events of a streamed completion, in order (`[DONE]` as the string)."""
    import json
    import urllib.request

    data = json.dumps({"model": "tiny", "stream": True, **body}).encode()
    request = urllib.request.Request(f"{server.url}/v1/completions", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = resp.read().decode()
    assert raw.endswith("\n\n")
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in raw.strip().split("\n\n")]


def test_a_streamed_completion_is_the_plain_one_in_chunks_and_an_abort_ends_it(server):
    body = dict(prompt=[5, 6, 7], max_tokens=40, temperature=1.0, seed=11, logprobs=0, return_token_ids=True)
    status, plain = complete(server, **body)
    assert status == 200, plain
    streamed = events(server, **body)
    assert streamed[-1] == "[DONE]" and len(streamed) > 3  # a chunk per decoding step
    choices = [e["choices"][0] for e in streamed[:-1]]
    assert choices[0]["prompt_token_ids"] == [5, 6, 7] and all(c["prompt_token_ids"] is None for c in choices[1:])
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [plain["choices"][0]["finish_reason"]]
    assert sum((c["token_ids"] for c in choices), []) == plain["choices"][0]["token_ids"]
    assert sum((c["logprobs"]["token_logprobs"] for c in choices), []) == plain["choices"][0]["logprobs"]["token_logprobs"]
    assert "".join(c["text"] for c in choices) == plain["choices"][0]["text"]

    base, results = server.stats(), {}
    thread = threading.Thread(target=lambda: results.__setitem__("r", events(
        server, prompt=[5, 6, 7], max_tokens=500, ignore_eos=True, return_token_ids=True, logprobs=0)))
    thread.start()
    try:
        wait_until(lambda: server.stats()["engine"]["tokens_generated"] - base["engine"]["tokens_generated"] >= 5, 30,
                   "the request to be generating")
        assert http("POST", f"{server.url}/pause?mode=abort")[1] == {"status": "paused"}
        thread.join(timeout=30)
        choices = [e["choices"][0] for e in results["r"][:-1]]
        assert choices[-1]["finish_reason"] == "abort" and results["r"][-1] == "[DONE]"
        assert 1 <= len(sum((c["token_ids"] for c in choices), [])) < 500  # the tokens sent before the abort
        stats = wait_until(lambda: (s := server.stats())["engine"]["active"] == 0 and s, 30, "the engine to drop it")
        assert stats["requests_aborted"] - base["requests_aborted"] == 1
    finally:
        http("POST", f"{server.url}/resume")


def test_a_client_that_disconnects_aborts_its_generation(server):
    base = server.stats()

    async def disconnect_mid_generation():
        async with aiohttp.ClientSession() as session:
            request = asyncio.ensure_future(session.post(f"{server.url}/v1/completions", json={
                "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "seed": 3}))
            while server.stats()["engine"]["active"] == 0:  # the test's own loop has nothing else to do
                assert not request.done(), "the request finished before it was seen generating"
                await asyncio.sleep(0.02)
            request.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(disconnect_mid_generation())
    stats = wait_until(lambda: (s := server.stats())["requests_aborted"] > base["requests_aborted"]
                       and s["engine"]["active"] == 0 and s["requests_active"] == 0 and s, 30, "the server to abort")
    assert stats["requests_aborted"] - base["requests_aborted"] == 1
    assert stats["engine"]["queued"] == 0
    generated = stats["engine"]["tokens_generated"] - base["engine"]["tokens_generated"]
    assert generated < 500, "the engine kept generating for a client that left"
    assert stats["requests_completed"] == base["requests_completed"]


def test_reload_weights_changes_the_outputs_and_the_served_version(server, model_dir, tmp_path):
    greedy = dict(prompt=[5, 6, 7, 8], max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True)
    original = complete(server, **greedy)[1]["choices"][0]["token_ids"]
    version = server.stats()["serving_version"]

    other = build_tiny(1)[0].state_dict()
    path = write_weights(other, tmp_path / "weights", version + 5, model_config=model_dir)
    assert http("POST", f"{server.url}/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}) == (200, {"results": [None]})
    assert server.stats()["serving_version"] == version + 5  # the publisher's version file
    changed = complete(server, **greedy)[1]["choices"][0]["token_ids"]
    assert changed != original

    status, out = http("POST", f"{server.url}/collective_rpc",
                       {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "missing")}})
    assert status == 400 and "missing" in out["error"]["message"]
    assert server.stats()["serving_version"] == version + 5 and server.stats()["reload_failures"] == 1

    # Back to the original weights (from the model directory itself: a version bump by one).
    assert http("POST", f"{server.url}/collective_rpc", {"method": "reload_weights", "kwargs": {}})[0] == 200
    assert server.stats()["serving_version"] == version + 6
    assert complete(server, **greedy)[1]["choices"][0]["token_ids"] == original


def test_a_reload_with_non_finite_weights_is_refused_and_the_old_weights_keep_serving(server, model_dir, tmp_path):
    greedy = dict(prompt=[5, 6, 7, 8], max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True)
    before = complete(server, **greedy)[1]["choices"][0]["token_ids"]
    stats = server.stats()
    state = build_tiny(0)[0].state_dict()
    state["model.norm.weight"] = state["model.norm.weight"].clone().fill_(float("nan"))
    path = write_weights(state, tmp_path / "weights", stats["serving_version"] + 1, model_config=model_dir)
    status, out = http("POST", f"{server.url}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
    assert status == 400, out
    message = out["error"]["message"]
    assert "NaN or inf" in message and "model.norm.weight" in message and "unchanged" in message and str(path) in message
    after = server.stats()
    assert after["serving_version"] == stats["serving_version"] and after["reload_failures"] == stats["reload_failures"] + 1
    assert after["engine_failure"] is None and http("GET", f"{server.url}/health")[0] == 200
    assert complete(server, **greedy)[1]["choices"][0]["token_ids"] == before


def test_a_failed_engine_is_replaced_by_the_next_good_reload(model_dir, tmp_path):
    """The engine's thread dies (here: NaN weights put into the engine directly, as any crash of its thread
    would); the server answers 500/503 until a good reload, which starts a new engine over the same model."""
    from aiohttp import web

    from asyncgrpo.generation.local import LocalEngine
    from asyncgrpo.generation.serve import STATE, create_app

    model, tokenizer = build_tiny(0)
    good = write_weights(build_tiny(0)[0].state_dict(), tmp_path / "weights", 3, model_config=model_dir)
    poisoned = {k: torch.full_like(v, float("nan")) for k, v in build_tiny(0)[0].state_dict().items()}

    async def main():
        engine = LocalEngine(model, tokenizer, name="serve-test")
        app = create_app(engine, tokenizer, model_name="tiny", max_model_len=512,
                         vocab_size=model.get_input_embeddings().num_embeddings,
                         engine_factory=lambda version: LocalEngine(model, tokenizer, name="serve-test", version=version))
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await engine.start()
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "return_token_ids": True}
        seen = {}
        try:
            async with aiohttp.ClientSession() as session:
                async def call(method, path, json=None):
                    async with session.request(method, f"{url}{path}", json=json) as resp:
                        return resp.status, await resp.text()

                await engine.load_weights(poisoned, 1)
                seen["dead_completion"] = (await call("POST", "/v1/completions", body))[0]
                seen["dead_health"] = (await call("GET", "/health"))[0]
                seen["reload"] = await call("POST", "/collective_rpc",
                                            {"method": "reload_weights", "kwargs": {"weights_path": str(good)}})
                seen["health"] = (await call("GET", "/health"))[0]
                seen["completion"] = await call("POST", "/v1/completions", body)
                seen["stats"] = app[STATE].stats()
        finally:
            await runner.cleanup()
            await app[STATE].engine.aclose()
        return seen

    seen = asyncio.run(main())
    assert seen["dead_completion"] == 500 and seen["dead_health"] == 503
    assert seen["reload"][0] == 200, seen["reload"]
    assert seen["health"] == 200 and seen["completion"][0] == 200, seen["completion"]
    assert seen["stats"]["engine_failure"] is None and seen["stats"]["serving_version"] == 3


def test_prompts_and_bodies_over_the_limits_are_refused_before_tokenising(server):
    """builtin:tiny has max_model_len 512, so --max-prompt-chars defaults to 16 x 512 = 8192 characters and the body
    limit to 1 MiB + 12 bytes per character. Over either, the answer names the limit and the flag that raises it."""
    before = server.stats()
    status, out = complete(server, prompt="a" * 8193, max_tokens=4)
    assert status == 400 and out["error"]["param"] == "prompt", out
    assert "8193 characters" in out["error"]["message"] and "--max-prompt-chars = 8192" in out["error"]["message"]
    # At the limit the prompt is tokenised: 8192 characters are 8192 tokens of this char-level tokenizer, too many.
    status, out = complete(server, prompt="a" * 8192, max_tokens=4)
    assert status == 400 and "longer than the maximum model length" in out["error"]["message"], out
    limit = (1 << 20) + 12 * 8192
    status, out = complete(server, prompt=[5] * (limit // 3 + 1), max_tokens=4)  # "5, " is 3 bytes
    assert status == 413 and out["error"]["code"] == 413, out
    assert f"limit of {limit} bytes" in out["error"]["message"] and "--max-prompt-chars" in out["error"]["message"]
    status, out = http("POST", f"{server.url}/collective_rpc", b" " * (limit + 1))
    assert status == 413 and "--max-prompt-chars" in out["error"]["message"], out
    assert http("GET", f"{server.url}/health")[0] == 200
    after = server.stats()
    assert after["requests_rejected"] - before["requests_rejected"] == 3
    assert after["engine"]["steps"] == before["engine"]["steps"]  # nothing reached the engine


def test_a_string_prompt_is_tokenised_off_the_event_loop(tmp_path):
    """The tokenizer holds a prompt until /health has been answered: on the event loop, it never would be."""
    from aiohttp import web

    from asyncgrpo.generation.local import LocalEngine
    from asyncgrpo.generation.serve import STATE, create_app

    model, tokenizer = build_tiny(0)

    class GatedTokenizer:
        """The tiny tokenizer, whose encoding waits (at most 20 s) for `release`; refuses if it was not set by then."""

        def __init__(self) -> None:
            self.entered, self.release = threading.Event(), threading.Event()

        def __deepcopy__(self, memo):  # the server tokenises with a copy of its own: let it be this one
            return self

        def __call__(self, text, **kwargs):
            self.entered.set()
            if not self.release.wait(20):
                raise RuntimeError("/health was not answered while a prompt was being tokenised")
            return tokenizer(text, **kwargs)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    gated = GatedTokenizer()

    async def main():
        engine = LocalEngine(model, tokenizer, name="serve-test")
        app = create_app(engine, gated, model_name="tiny", max_model_len=512,
                         vocab_size=model.get_input_embeddings().num_embeddings)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await engine.start()
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as session:
                async def call(method, path, json=None):
                    async with session.request(method, f"{url}{path}", json=json) as resp:
                        return resp.status, await resp.text()

                completion = asyncio.ensure_future(call("POST", "/v1/completions", {
                    "model": "tiny", "prompt": "say c: ", "max_tokens": 4, "seed": 1}))
                assert await asyncio.to_thread(gated.entered.wait, 20), "the prompt was never tokenised"
                health = await call("GET", "/health")
                gated.release.set()
                return health, await completion
        finally:
            gated.release.set()
            await runner.cleanup()
            await app[STATE].engine.aclose()
            app[STATE].prompt_threads.close()

    health, completion = asyncio.run(main())
    assert health[0] == 200 and completion[0] == 200, (health, completion)


def test_a_reload_from_a_fifo_is_refused_and_the_server_keeps_serving_and_stops_on_sigint(model_dir, tmp_path):
    """A FIFO named like a weights file would block the read until a writer came (safetensors held the GIL while it
    waited: nothing else answered, SIGINT included). It is refused, naming it; so are a device behind a symlink and a
    FIFO version file; a good reload then works and SIGINT stops the server."""
    import os
    import signal

    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "model.safetensors")
    device_dir = tmp_path / "device"
    device_dir.mkdir()
    (device_dir / "model.safetensors").symlink_to("/dev/zero")
    marker_dir = write_weights(build_tiny(1)[0].state_dict(), tmp_path / "weights", 7, model_config=model_dir)
    (marker_dir / "asyncgrpo_version.json").unlink()
    os.mkfifo(marker_dir / "asyncgrpo_version.json")

    proc = ServeProcess(model_dir, tmp_path, extra=("--served-model-name", "tiny")).start()
    try:
        proc.wait_healthy()
        cases = [(fifo_dir / "model.safetensors", "FIFO"), (device_dir / "model.safetensors", "character device"),
                 (marker_dir / "asyncgrpo_version.json", "FIFO")]
        for path, kind in cases:
            status, out = http("POST", f"{proc.url}/collective_rpc",
                               {"method": "reload_weights", "kwargs": {"weights_path": str(path.parent)}})
            assert status == 400, out
            assert f"{path} is not a regular file (it is a {kind})" in out["error"]["message"], out
            assert http("GET", f"{proc.url}/health")[0] == 200
        stats = proc.stats()
        assert stats["reload_failures"] == len(cases) and stats["serving_version"] == 0
        assert http("POST", f"{proc.url}/collective_rpc", {"method": "reload_weights", "kwargs": {}}) == (200, {"results": [None]})
        assert proc.stats()["serving_version"] == 1
        assert complete(proc, prompt=[5, 6, 7], max_tokens=4)[0] == 200
        proc.proc.send_signal(signal.SIGINT)
        assert proc.proc.wait(timeout=30) == 0, proc.log()
    finally:
        proc.kill()
