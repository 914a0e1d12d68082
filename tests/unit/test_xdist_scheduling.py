"""`make test`'s two workers never run two Ray clusters or two vLLM servers at once: every test file that starts one
is in that resource's work unit (tests/xdist_scheduling.py), whatever the file is called (a sub-package's
conftest.py counts as part of its files: tests/integration/vllm/conftest.py starts the server they share)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.xdist_scheduling import start_order, work_unit

TESTS = Path(__file__).resolve().parents[1]
STARTS = {
    "ray": re.compile(r"\bray_tmpdir\b|\blocal_cluster\(|^import ray\b|= pytest\.importorskip\(\"ray\"", re.M),
    "vllm": re.compile(r"from tests\.integration\.vllm_server import|\bstart_vllm", re.M),
}
TEST_FILES = sorted(p for tier in ("component", "integration") for p in (TESTS / tier).rglob("test_*.py"))


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_a_file_that_starts_a_shared_resource_is_in_its_work_unit(path: Path) -> None:
    # A sub-package's conftest.py starts what its fixtures give the package's files (the tier's own only defines
    # fixtures, e.g. ray_tmpdir, that the files using them name).
    conftest = path.parent / "conftest.py"
    shared = conftest.read_text() if conftest.is_file() and path.parent.parent != TESTS else ""
    source = path.read_text() + shared
    unit = work_unit(f"{path.relative_to(TESTS.parent).as_posix()}::test_x")
    for group, starts in STARTS.items():
        if starts.search(source):
            assert unit == group, f"{path.name} starts {group} but runs in work unit {unit!r}: name it or add it to SHARED_RESOURCE_GROUPS"


def test_other_files_are_their_own_unit_and_a_files_tests_share_one() -> None:
    assert work_unit("tests/unit/test_sync.py::test_a[1]") == work_unit("tests/unit/test_sync.py::test_b") == "tests/unit/test_sync.py"
    assert work_unit("tests/integration/test_ray_train.py::t") == work_unit("tests/integration/test_ray_connect.py::t") == "ray"
    assert work_unit("tests/integration/vllm/test_vllm_sampling.py::t") == work_unit("tests/integration/test_readme_commands.py::t") == "vllm"


def test_the_slowest_units_start_first_the_shared_resources_then_the_tiers_from_processes_to_pure_logic() -> None:
    units = ["tests/unit/test_sync.py", "tests/sim/test_chaos.py", "vllm", "tests/component/test_checkpoint.py",
             "tests/integration/test_resume.py", "ray", "tests/unit/test_config.py"]
    assert sorted(units, key=start_order) == ["ray", "vllm", "tests/integration/test_resume.py", "tests/component/test_checkpoint.py",
                                              "tests/sim/test_chaos.py", "tests/unit/test_sync.py", "tests/unit/test_config.py"]
