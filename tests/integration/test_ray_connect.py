"""`RayCluster.connect()` in a driver process of its own: joining an address where no Ray cluster answers fails, named
and bounded, and the driver still exits cleanly; a local cluster stays on this machine and this user.

Each test runs a small driver (`DRIVER`) with HOME and RAY_TMPDIR of the test's own, so what Ray writes is the test's
to look at (and a Ray thread the driver abandons dies with it). The driver prints one JSON line: the error, or what
the local cluster looked like while it ran (every listening socket of the driver and its descendants, found with
psutil as `ss -ltnp` would show them; the mode of its directories), then whether its directory is gone after
`disconnect()`.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

from tests.integration.ray_cluster import ray  # noqa: F401 - skips the module where Ray is not installed

DRIVER = textwrap.dedent("""
    import asyncio, glob, json, os, sys
    from asyncgrpo.config import RayConfig
    from asyncgrpo.errors import GenerationError
    from asyncgrpo.generation.ray_cluster import RayCluster

    async def main(address, timeout_s):
        cluster = RayCluster(RayConfig(address=address or None, num_cpus=1, startup_timeout_s=timeout_s), timeout_s=60)
        try:
            await cluster.connect()
        except GenerationError as exc:
            return {"error": str(exc)}
        import psutil, ray

        @ray.remote
        def pid():
            return os.getpid()

        ray.get(pid.remote())  # a worker, listening like every Ray process
        me = psutil.Process()
        listening = sorted({(p.name(), c.laddr.ip) for p in [me, *me.children(recursive=True)]
                            for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN})
        private = glob.glob(os.path.join(os.environ["RAY_TMPDIR"], "agr-*"))
        modes = [oct(os.stat(path).st_mode & 0o777) for path in private]
        sessions = glob.glob(os.path.join(os.environ["RAY_TMPDIR"], "agr-*", "ray", "session_2*"))
        elsewhere = glob.glob(os.path.join(os.environ["RAY_TMPDIR"], "ray", "session_*"))  # Ray's default place
        await cluster.disconnect()
        return {"listening": listening, "private": private, "modes": modes, "sessions": sessions, "elsewhere": elsewhere,
                "removed": not any(os.path.exists(path) for path in private), "token_env": "RAY_AUTH_TOKEN" in os.environ}

    print(json.dumps(asyncio.run(main(sys.argv[1], float(sys.argv[2])))), flush=True)
""")


def drive(tmp_path, ray_tmpdir, address: str, timeout_s: float) -> tuple[dict, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", DRIVER, address, str(timeout_s)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "HOME": str(home), "RAY_TMPDIR": ray_tmpdir})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@pytest.mark.timeout(90)
def test_joining_an_address_where_nothing_listens_fails_at_once_naming_it(tmp_path, ray_tmpdir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    out, _ = drive(tmp_path, ray_tmpdir, f"127.0.0.1:{port}", 600)
    error = out["error"]
    assert f"ray.address = '127.0.0.1:{port}'" in error and f"nothing accepts connections at 127.0.0.1:{port}" in error
    assert "Connection refused" in error and "ray.address: null" in error and f"ray start --head --port={port}" in error


@pytest.mark.timeout(90)
def test_joining_an_address_that_accepts_but_is_no_ray_cluster_ends_at_the_startup_timeout(tmp_path, ray_tmpdir):
    """A socket that accepts connections and never answers: ray.init would wait forever. The driver gives up at
    ray.startup_timeout_s, says what it tried, and exits cleanly although a thread of it is still inside ray.init."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        out, stderr = drive(tmp_path, ray_tmpdir, f"127.0.0.1:{port}", 5)
    error = out["error"]
    assert f"ray.address = '127.0.0.1:{port}' within ray.startup_timeout_s = 5 s" in error, error
    assert f"a TCP connection to 127.0.0.1:{port} was accepted; then ray.init(address='127.0.0.1:{port}')" in error
    assert "abandoned" in error and "ray.address: null" in error
    assert f"Connecting to existing Ray cluster at address: 127.0.0.1:{port}" in stderr, stderr  # not rewritten


@pytest.mark.timeout(240)
def test_a_local_cluster_listens_on_loopback_only_and_keeps_its_files_and_token_private(tmp_path, ray_tmpdir):
    out, _ = drive(tmp_path, ray_tmpdir, "", 120)
    assert "error" not in out, out
    names = {name for name, _ in out["listening"]}
    assert {"gcs_server", "raylet"} <= names, out["listening"]
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for _, ip in out["listening"]), out["listening"]
    assert len(out["private"]) == 1 and out["modes"] == [oct(stat.S_IRWXU)], out  # Ray's own dirs in it are 0777
    assert len(out["sessions"]) == 1 and not out["elsewhere"], out
    assert out["removed"], f"{out['private']} was left after disconnect()"
    assert out["token_env"] is False  # the token was in the environment only while the cluster started
    assert not (tmp_path / "home" / ".ray").exists(), list((tmp_path / "home" / ".ray").iterdir())  # no token file
