"""The fast tier's guard (tests/tier_guard.py): in a child pytest on a copy of tests/conftest.py and the guard, a test in
tests/unit that starts a process (subprocess, or multiprocessing's spawn, which raises no audit event), binds a
network socket or takes an optimizer step fails, naming what it did; a pure one passes, and the same tests in
tests/component all pass."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
TESTS = Path(__file__).resolve().parents[1]

OFFENDERS = '''
import multiprocessing
import socket
import subprocess
import sys

import torch


def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_spawns_a_process():
    child = multiprocessing.get_context("spawn").Process(target=print)
    child.start()
    child.join()


def test_binds_a_server_socket():
    socket.create_server(("127.0.0.1", 0)).close()


def test_takes_an_optimizer_step():
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    (weight + 1).sum().backward()
    optimizer.step()


def test_adds():
    assert sum([1, 2]) == 3
'''

EXPECTED = {
    "test_starts_a_process": "started a process (subprocess.Popen",
    "test_spawns_a_process": "started a process (_posixsubprocess.fork_exec",
    "test_binds_a_server_socket": "opened a network socket (socket.bind to ('127.0.0.1', 0))",
    "test_takes_an_optimizer_step": "took an optimizer step (SGD.step)",
}


def test_a_fast_tier_test_that_starts_a_process_binds_a_socket_or_trains_fails_naming_it(tmp_path):
    tests = tmp_path / "tests"
    for tier in ("unit", "component"):
        (tests / tier).mkdir(parents=True)
        (tests / tier / "__init__.py").write_text("")
        (tests / tier / f"test_{tier}_offenders.py").write_text(OFFENDERS)
    (tests / "__init__.py").write_text("")
    for name in ("conftest.py", "tier_guard.py"):
        shutil.copy(TESTS / name, tests / name)

    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=100)
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    assert "10 passed, 4 errors" in out, out  # every call passes; the four offenders' teardown reports fail
    for name, what in EXPECTED.items():
        assert f"tests/unit/test_unit_offenders.py::{name} is in the fast tier" in out, out
        assert f"this test {what}" in out, out
    assert "test_unit_offenders.py::test_adds is in the fast tier" not in out
    assert "test_component_offenders.py::" not in out.split("short test summary info")[-1], out
