"""Fixtures shared by the integration tests."""

from __future__ import annotations

import shutil

import pytest

from tests.integration.ray_cluster import kill_processes, left_after, short_temp_dir


@pytest.fixture
def ray_tmpdir():
    """The runs' RAY_TMPDIR; afterwards no process of their clusters may be left (any found is killed, then reported)."""
    temp_dir = short_temp_dir()
    yield temp_dir
    left = left_after(temp_dir)
    kill_processes(left)
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"Ray processes left after the run: {left}"
