"""`HttpGenerator` over 256 servers: one fake OpenAI-compatible server listening on 256 ports (real HTTP).

- Requests are spread evenly over the healthy servers (least open requests, the first listed among
  equals: at every dispatch the open requests of healthy servers differ by at most one), servers that
  are down take none, and servers back up take work again until they have caught up.
- Choosing a server for a request scans no list of servers.
- With every server down, a waiting request is woken by no failed probe, only by a server coming back,
  and is then served by it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from asyncgrpo.generation.http import HttpGenerator
from tests.integration.servers import FakeServer
from tests.integration.test_http_generator import recipe, request, run

pytestmark = pytest.mark.timeout(240)

N = 256


async def eventually(predicate: Callable[[], bool], what: str, deadline_s: float = 60.0) -> None:
    """Await `predicate()` (the generator's state, changed by its probes on this loop); fail naming `what`."""
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"timed out after {deadline_s:g} s waiting for {what}"
        await asyncio.sleep(0.02)


class CountingList(list):
    """A list that counts how often it is iterated (a scan over the servers)."""

    scans = 0

    def __iter__(self):
        self.scans += 1
        return super().__iter__()


def open_requests(servers: list) -> dict[str, int]:
    return {s.url: s.outstanding for s in servers}


def test_256_servers_share_requests_evenly_skip_the_down_ones_and_take_work_again_when_back():
    async def main():
        fake = await FakeServer(ports=N).start()
        fake.completion = "hang"  # every request stays open: the open requests are what was dispatched
        urls = fake.urls
        # Probes every 3 s with a 3 s answer bound: a healthy port's probe is never late enough to be taken for a down
        # server on a loaded machine (at 0.5 s it was, at load 15, and the round robin below then skipped it).
        gen = HttpGenerator(recipe(urls, generation={"health_probe_interval_s": 3.0,
                                                     "backend_dead_after_s": 120.0}).generation)
        await gen.start()
        tasks: list[asyncio.Task] = []
        try:
            down = [urls[3], urls[100], urls[N - 1]]
            for url in down:
                await fake.close_port(url)
            await eventually(lambda: not any(s["healthy"] for s in gen.stats()["servers"] if s["url"] in down),
                             "the probes to mark the closed ports unhealthy")
            up = [url for url in urls if url not in down]
            servers = list(gen._pool.servers)
            gen._pool.servers = CountingList(servers)
            for i in range(3 * len(up)):
                tasks.append(asyncio.create_task(gen.generate(request(i))))
                await asyncio.sleep(0)  # the request is dispatched (its server chosen and counted) before it awaits
                opens = open_requests(servers)
                assert [opens[url] for url in down] == [0, 0, 0]
                # Round robin in list order: the first (i + 1) % len(up) healthy servers have one more.
                assert [opens[url] for url in up] == [(i + 1) // len(up) + (j < (i + 1) % len(up))
                                                      for j in range(len(up))]
            assert gen._pool.servers.scans == 0  # no request scanned the servers
            gen._pool.servers = servers
            await eventually(lambda: fake.started == len(tasks), "every request to reach the server")
            assert {url: fake.by_url.get(url, 0) for url in urls} == {url: 0 if url in down else 3 for url in urls}

            for url in down:
                await fake.open_port(url)
            # Recovered: healthy again (counted, not compared: on a loaded machine a probe of an up server may time out and
            # that server recover too, which is not what this waits for).
            await eventually(lambda: all(s["healthy"] for s in gen.stats()["servers"] if s["url"] in down)
                             and gen.stats()["recoveries"] >= len(down), "the servers back up to be recovered")
            for i in range(3 * len(down)):  # they have caught up once each has as many open requests as the others
                tasks.append(asyncio.create_task(gen.generate(request(1000 + i))))
                await asyncio.sleep(0)
                opens = open_requests(servers)
                assert max(opens.values()) - min(opens[url] for url in down) <= 3
            assert set(open_requests(servers).values()) == {3}
            await eventually(lambda: fake.started == len(tasks), "every request to reach the server")
            assert [fake.by_url[url] for url in down] == [3, 3, 3]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await gen.aclose()
            await fake.stop()

    run(main(), timeout_s=200)


def test_with_256_servers_down_a_waiting_request_is_woken_by_no_failed_probe_and_served_by_the_first_back():
    async def main():
        fake = await FakeServer(ports=N).start()
        urls = fake.urls
        gen = HttpGenerator(recipe(urls, generation={"health_probe_interval_s": 0.2,
                                                     "backend_dead_after_s": 120.0}).generation)
        await gen.start()
        pool = gen._pool
        wakes = 0
        notify = pool.signal.notify

        def counting_notify() -> None:
            nonlocal wakes
            wakes += 1
            notify()

        try:
            for url in urls:
                await fake.close_port(url)
            await eventually(lambda: not any(s.healthy for s in pool.servers), "every server to be marked unhealthy")
            pool.signal.notify = counting_notify  # type: ignore[method-assign]
            waiting = asyncio.create_task(gen.generate(request(0)))
            epochs = [s.epoch for s in pool.servers]
            await eventually(lambda: all(s.epoch >= e + 2 for s, e in zip(pool.servers, epochs, strict=True)),
                             "every server to fail two more probes")
            assert not waiting.done() and wakes == 0  # 512 failed probes, no wake-up
            await fake.open_port(urls[200])
            completion = await waiting
            assert completion.token_ids == (7, 8, 9) and fake.by_url == {urls[200]: 1}
            assert wakes == 1  # the first server back
        finally:
            await gen.aclose()
            await fake.stop()

    run(main(), timeout_s=200)
