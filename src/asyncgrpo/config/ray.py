"""The ray: section: `runtime: ray`'s cluster, its generator actors and trainer ranks, and their resources."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncgrpo.config.section import Section


class RayRole(Section):
    """Ray resources one actor of a role reserves (Ray places it on a node that has them)."""

    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per actor (Ray sets its OpenMP threads to this, at least 1).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per actor (fractions share a GPU).")
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = Field(
        None, description="null: Ray places each actor where it fits; else the role's actors are one placement group of this "
        "strategy (PACK: as few nodes as possible, SPREAD: as many; STRICT_: or not at all).")

    @model_validator(mode="after")
    def _bundle(self) -> RayRole:
        if self.placement is not None and self.num_cpus == 0 and self.num_gpus == 0:
            raise ValueError(f"placement = {self.placement} reserves a bundle per actor, but num_cpus and num_gpus are both 0. "
                             f"Fix: give the role num_cpus or num_gpus, or set placement: null.")
        return self


class RayConfig(Section):
    """`runtime: ray`: generators (and, with train.world_size > 1, trainer ranks) as Ray actors (docs/ray.md)."""

    address: str | None = Field(
        None, description="null: start a local Ray cluster for this run and stop it at the end; else the cluster to join "
        "('auto', 'host:6379' or 'ray://host:10001'), which is left running.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local cluster started when ray.address is null (null: every core).")
    generators: int = Field(2, ge=1, description="Generator actors, each an in-process engine on its own copy of the weights.")
    generator: RayRole = Field(default_factory=RayRole)
    max_restarts: int = Field(3, ge=0, description="Restarts of a generator actor that died; it loads the current weights before it takes work.")
    startup_timeout_s: float = Field(
        120.0, gt=0, description="Time to start or join the cluster (ray.init, which never returns where no cluster "
        "answers), and again for the actors to be placed and built (Ray never places one that does not fit).")
    trainer: RayRole = Field(default_factory=RayRole, description="Resources of each trainer rank (train.world_size > 1).")
    trainer_timeout_s: float = Field(
        1800.0, gt=0, description="Longest wait for the trainer ranks in one call (a step, the weights, a checkpoint); "
        "a rank that takes longer fails the run, named.")

