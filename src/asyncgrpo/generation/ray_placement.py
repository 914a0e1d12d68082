"""`RolePlacement`: the actors of one role (generators, trainer ranks) in one Ray placement group, or each on its own.

Job: with `ray.<role>.placement` set (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD), reserve one bundle
per actor (its `num_cpus` and `num_gpus`) as one placement group before any actor of the role is
created, give each actor its bundle, and remove the group when the role ends. With `placement:
null` Ray places each actor wherever it fits, and this does nothing.

Invariants:
- The reservation is all or nothing (Ray's placement groups are) and bounded: a group the
  cluster cannot hold within the caller's timeout is removed and raises TimeoutError, which the
  caller turns into its paragraph (`describe()` says what was asked).
- `release()` is idempotent; actors of the role must be killed first.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.config import RayRole
from asyncgrpo.generation.ray_cluster import import_ray
from asyncgrpo.threads import run_in_daemon_thread


class RolePlacement:
    def __init__(self, role: RayRole, count: int, *, key: str) -> None:
        self.role, self.count, self.key = role, count, key
        self._group: Any = None

    def describe(self) -> str:
        if self.role.placement is None:
            return f"{self.key}.placement = null (each actor placed on its own)"
        return (f"{self.key}.placement = {self.role.placement}: {self.count} bundles of {self._bundle()} in one placement "
                f"group")

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.role.num_cpus, "GPU": self.role.num_gpus}
        return {name: amount for name, amount in bundle.items() if amount > 0}

    async def reserve(self, timeout_s: float) -> None:
        """Create the placement group and wait until the cluster holds all of it (TimeoutError after `timeout_s`)."""
        if self.role.placement is None:
            return
        from ray.util.placement_group import placement_group

        self._group = placement_group([self._bundle()] * self.count, strategy=self.role.placement)
        if not await run_in_daemon_thread(lambda: self._group.wait(timeout_s), name="asyncgrpo-ray-placement"):
            await self.release()
            raise TimeoutError

    def options(self, index: int) -> dict[str, Any]:
        """The `.options(...)` that put actor `index` of the role into its bundle."""
        if self._group is None:
            return {}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=index)}

    async def release(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            import_ray()
            from ray.util.placement_group import remove_placement_group

            await run_in_daemon_thread(lambda: remove_placement_group(group), name="asyncgrpo-ray-placement-release")
