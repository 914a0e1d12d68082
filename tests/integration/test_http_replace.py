"""A server of the HTTP pool replaced by a new process at another URL (`HttpGenerator.replace_server`: a launched
server whose actor died, generation/launch.py), over in-process fake servers: the slot gets the current weights
before it takes work; a request still open to the old URL fails over as any failed attempt does, and its failure
does not take the new server out; a server that stays down for good is named with why in the dead-backend error."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncgrpo.errors import BackendDeadError, TransientGenerationError
from asyncgrpo.generation.http import HttpGenerator
from tests.integration.servers import FakeServer, until
from tests.integration.test_http_generator import learn_latencies, recipe, request, run

pytestmark = pytest.mark.timeout(60)


def usable(gen: HttpGenerator, position: int) -> bool:
    server = gen.stats()["servers"][position]
    return server["healthy"] and server["excluded"] is None and server["hung"] is None


def test_a_replaced_server_gets_the_current_weights_before_work_and_a_request_open_to_the_old_url_fails_over(tmp_path):
    async def main():
        first, old, new = await FakeServer().start(), await FakeServer().start(), await FakeServer().start()
        reloads_seen = []  # per completion the new server answers: how many reloads it had had by then
        new.fault = lambda number, body: reloads_seen.append(sum(c.startswith("reload") for c in new.control))
        gen = HttpGenerator(recipe([first.url, old.url]).generation, weights_dir=tmp_path / "weights")
        await gen.start()
        try:
            await gen.load_weights({"w": torch.zeros(2)}, 1)
            old.freeze()  # answers nothing: a request to it stays open
            held = [asyncio.create_task(gen.generate(request(i))) for i in range(2)]  # the second goes to `old`
            await until(lambda: gen.stats()["servers"][1]["outstanding"] == 1, 10, "a request open to the old server")
            gen.replace_server(1, new.url, "its actor died")
            assert gen.servers[1] == new.url and not usable(gen, 1)
            await until(lambda: usable(gen, 1), 20, "the new server to take work")
            assert [c for c in new.control if c.startswith("reload")] and new.started == 0
            marks = gen.stats()["unhealthy_marks"]
            old.completion = "reset"
            old.thaw()  # the old process's connection breaks
            outcomes = await asyncio.gather(*held, return_exceptions=True)
            assert usable(gen, 1) and gen.stats()["unhealthy_marks"] == marks  # the old URL's failure is not the new one's
            after = await asyncio.gather(*(gen.generate(request(10 + i)) for i in range(8)))
            return outcomes, after, reloads_seen, old.url
        finally:
            await gen.aclose()
            for server in (first, old, new):
                await server.stop()

    (answered, failed), after, reloads_seen, old_url = run(main())
    assert answered.versions == (1, 1, 1)
    assert isinstance(failed, TransientGenerationError) and f"to {old_url} failed" in str(failed)  # the caller retries it
    assert reloads_seen and all(seen >= 1 for seen in reloads_seen)  # work only once it had the weights
    assert all(set(c.versions) == {1} for c in after)


def test_a_request_to_the_old_url_that_times_out_is_not_booked_against_the_new_server(tmp_path):
    async def main():
        first, old, new = await FakeServer().start(), await FakeServer().start(), await FakeServer().start()
        http = {"base_urls": [first.url, old.url], "attempt_timeout_min_s": 0.3}
        gen = HttpGenerator(recipe(http["base_urls"], generation={"http": http}).generation, weights_dir=tmp_path / "weights")
        await gen.start()
        try:
            await gen.load_weights({"w": torch.zeros(2)}, 1)
            await learn_latencies(gen)  # attempts get a budget of their own (0.3 s), below generation.request_timeout_s
            old.freeze()  # answers nothing: the request to it times out after the replacement
            held = [asyncio.create_task(gen.generate(request(i))) for i in range(2)]  # the second goes to `old`
            await until(lambda: gen.stats()["servers"][1]["outstanding"] == 1, 10, "a request open to the old server")
            gen.replace_server(1, new.url, "its actor died")
            outcomes = await asyncio.gather(*held, return_exceptions=True)  # the old URL's at its overdue limit
            old.thaw()
            return outcomes, gen.stats()["servers"][1], old.url
        finally:
            await gen.aclose()
            for server in (first, old, new):
                await server.stop()

    (answered, timed_out), replaced, old_url = run(main())
    assert answered.versions == (1, 1, 1)
    assert f"to {old_url} got no answer" in str(timed_out)  # the caller retries it
    assert replaced["last_error"].startswith("replaced ") and replaced["hung"] is None  # the old process timed out, not the new one


def test_a_server_gone_for_good_is_named_with_why_when_no_server_is_left():
    async def main():
        fake = await FakeServer().start()
        gen = HttpGenerator(recipe([fake.url], generation={"backend_dead_after_s": 0.5}).generation)
        await gen.start()
        try:
            await fake.stop()
            gen.server_gone(0, "launched server server-0 stays down: its actor died; max_restarts = 1 spent")
            with pytest.raises(BackendDeadError) as info:
                while True:  # the collector's retries, without backoff
                    try:
                        await gen.generate(request(0))
                    except TransientGenerationError:
                        continue
            return str(info.value), fake.url
        finally:
            await gen.aclose()

    message, url = run(main())
    assert f"{url}: unreachable (launched server server-0 stays down: its actor died; max_restarts = 1 spent)" in message
