"""The package's floor plan, and the rules every import keeps.

The floors follow the data (LAYERS, bottom first): the words every module speaks, the carriers,
the machine (threads, files, processes), the recipe, what a run shares (metric names, the run
directory); then models, prompts and their completion, scoring and hosting episodes, the
algorithms, the rollouts, training, the loop that ties them (pipeline, with evaluation beside it),
telemetry, the wiring of a run, the commands and, on top, the Python API. A unit is one entry of LAYERS: a package or
a loose module (the longest entry that matches a module places it).

The rules, one test each; every import statement counts, wherever it is (at module level, inside
a function, under `if TYPE_CHECKING:`): an import inside a function is still a dependency (the
module cannot run, be tested or move without its target), and a cycle that closes through one is
still a cycle (rewards/pool -> rewards/worker -> rewards/scoring -> rewards/pool did, through an
import inside rewards/worker.py's `main()`, until issue 21).
1. Every module has a floor.
2. No import points up: a module imports its own floor and the floors below.
3. The units of one floor are independent: one imports another only through an edge SIDEWAYS
   names and explains.
4. No cycles: not between units, and not between the modules of one unit.
5. No module imports another unit's private name (`from asyncgrpo.rewards.worker import
   _die_with_parent`): a helper two units need moves down to where both can import it.
6. A floor holds at most MAX_UNITS_PER_FLOOR units.
7. The top level of the package holds only TOP_LEVEL's loose modules, each with its reason: what
   several floors share (errors, carriers, metric names, the run directory, ...), the loop
   and evaluation beside it (pipeline, evaluation: wiring/ and the commands use them) and the
   Python API (api.py, the package's front door). Everything else lives in its package.

Tests, bench/ and scripts/ are outside the package and are not checked.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncgrpo

PACKAGE = Path(asyncgrpo.__file__).parent

# Bottom first. Each name is a package (all its modules) or a loose module at the top of the package.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "sync", "sampling"),  # words every module speaks: exceptions, the wait primitive, the sampling rule
    ("types", "objects", "user_modules", "tasks"),  # what flows: carriers, `python:` objects, the user's modules, built-in tasks
    ("threads", "atomic", "worker_process"),  # the machine: daemon-thread calls, atomic files, worker processes
    # the recipe's parts: the train.loss section, TRL's names for our keys, the algorithms' names (the registry's table)
    ("loss_config", "trl_names", "algorithms.names"),
    ("config", "trl_convert"),  # the recipe; a TRL GRPOConfig converted to one
    # what a run shares: metric names, its directory, a Config from Python, draws from the simulator's distributions
    ("metric_names", "rundir", "api_config", "distributions"),
    ("models",),  # model.path -> (model, tokenizer); the builtin models
    ("data", "generation"),  # prompts; their completion (engines, servers, the scripted backend)
    ("rewards", "environments"),  # what a rollout calls: scoring, and the hosts of multi-turn episodes
    ("agents",),  # agents written against the OpenAI client: the gateway, its sessions, their episodes
    ("distill",),  # on-policy distillation's parts: the teacher, judging a taught sample, its advantages
    ("algorithms.base",),  # the algorithm seam's protocol: what rollout and training ask of an algorithm
    ("rollout",),  # a group's life: admission, slots, retries, judging, the buffer, the books
    ("algorithms",),  # GRPO and distillation behind the protocol (they use rollout's judge), the registry
    ("training",),  # the loss family, the torch trainer and its ranks, checkpoints
    ("pipeline", "evaluation"),  # the loop; held-out evaluation beside it
    ("telemetry",),  # metrics, samples, trackers, the timeline, the console
    # one place that wires a run (train's and simulate's parts, in one order); calibrating the simulator from a run's records
    ("wiring", "tuning"),
    ("commands",),  # what a user runs: train, simulate, check, plot, serve, tune, convert-trl (cli.py)
    ("api",),  # the Python API, asyncgrpo.Trainer: the front door beside the CLI
)

MAX_UNITS_PER_FLOOR = 4

# Imports between two units of one floor, (importer, imported): why the floor keeps both.
SIDEWAYS: dict[tuple[str, str], str] = {
    ("trl_names", "loss_config"): "TRL's loss_type values are checked against the loss section's own list (BUILTIN_TYPES)",
}

# The loose modules at the top of the package, and why each is there (rule 7).
TOP_LEVEL: dict[str, str] = {
    "errors": "the exceptions of every floor",
    "sync": "StateSignal, the one wait primitive of generation, rewards, rollout, distill and the books",
    "sampling": "the sampled distribution and its log-probs: the carriers, the engines, the trainer and the teacher (distill/)",
    "types": "the frozen carriers every floor passes on",
    "objects": "`python:` objects: data, rewards, environments and the API resolve them",
    "user_modules": "the module loader: rewards, environments and the loss plug-in (training) import the user's code with it",
    "tasks": "the built-in tasks and their rewards: data, rewards and environments read them",
    "threads": "daemon-thread calls: generation, rewards, rollout, training and the commands",
    "atomic": "atomic files: models, generation, training, telemetry and the run directory",
    "worker_process": "worker processes: rewards' and environments' (the two users on one floor)",
    "loss_config": "the train.loss section: the recipe, TRL's names and the trainer read it",
    "trl_names": "TRL's names: the recipe's validator (its help) and the TRL converter",
    "trl_convert": "a TRL GRPOConfig as a recipe: build_config(args=...) and `asyncgrpo convert-trl`",
    "metric_names": "metric names: rollout, training, telemetry and the commands fill or read them",
    "rundir": "the run directory's files: training (checkpoints), telemetry, the commands and the API",
    "api_config": "a Config from Python objects: the API and the CLI's overrides (commands) build one",
    "distributions": "draws from the simulator's distributions: the scripted backend, environment and teacher, the simulator",
    "pipeline": "the loop: wiring/ builds it, train and simulate (commands/) run it",
    "evaluation": "held-out evaluation beside the loop (commands/train.py), through the rollouts' retry policy",
    "api": "the Python API (asyncgrpo.Trainer), re-exported by asyncgrpo/__init__.py",
}

@dataclass(frozen=True)
class Import:
    """One asyncgrpo name an asyncgrpo module imports: `target` is a module, `name` the name taken from it (or None)."""

    module: str
    line: int
    target: str
    name: str | None


def package_modules() -> dict[str, Path]:
    """Every module of the package, dotted without the `asyncgrpo.` prefix (a package is its __init__)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every asyncgrpo import in `path`, wherever the statement is; `known` are the package's module names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [Import(module, node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import; asyncgrpo imports are absolute")
            base = node.module or ""
            for alias in node.names:
                # `from asyncgrpo.training import checkpoint` imports a module; `from asyncgrpo.types import X` a name.
                submodule = f"{base}.{alias.name}".removeprefix("asyncgrpo.")
                if submodule in known or base == "asyncgrpo":
                    found.append(Import(module, node.lineno, f"{base}.{alias.name}", None))
                else:
                    found.append(Import(module, node.lineno, base, alias.name))
    return [
        Import(i.module, i.line, i.target.removeprefix("asyncgrpo."), i.name)
        for i in found
        if i.target.startswith("asyncgrpo.")
    ]


@functools.cache
def package_imports() -> tuple[Import, ...]:
    modules = package_modules()
    return tuple(i for module, path in modules.items() for i in imports_of(module, path, set(modules)))


def unit_of(module: str) -> str | None:
    """The LAYERS entry that places `module` (the longest that matches), or None."""
    names = [name for floor in LAYERS for name in floor if module == name or module.startswith(name + ".")]
    return max(names, key=len) if names else None


def floor_of(module: str) -> int | None:
    unit = unit_of(module)
    return None if unit is None else next(index for index, floor in enumerate(LAYERS) if unit in floor)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def violations(imports: Sequence[Import]) -> dict[str, list[str]]:
    """Rules 2-5 over `imports`: a key per violation -> the import lines behind it."""
    found: dict[str, list[str]] = defaultdict(list)
    unit_graph: dict[str, set[str]] = defaultdict(set)
    module_graph: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        where = f"{i.module}:{i.line} imports {i.target}" + (f".{i.name}" if i.name else "")
        own, theirs = floor_of(i.module), floor_of(i.target)
        assert own is not None and theirs is not None, f"{where}: not placed in LAYERS"
        unit, their_unit = unit_of(i.module), unit_of(i.target)
        assert unit is not None and their_unit is not None
        if theirs > own:
            found[f"upward: {i.module} imports {i.target}"].append(where)
        if unit != their_unit:
            unit_graph[unit].add(their_unit)
            if theirs == own and (unit, their_unit) not in SIDEWAYS:
                found[f"sideways: {unit} -> {their_unit}"].append(where)
            if i.name is not None and i.name.startswith("_") and not i.name.startswith("__"):
                found[f"private: {i.module} imports {i.target}.{i.name}"].append(where)
        elif i.module != i.target:
            module_graph[i.module].add(i.target)
    for component in strongly_connected(unit_graph):
        found[f"cycle between units: {', '.join(component)}"] += cycle_lines(component, imports, unit_of)
    for component in strongly_connected(module_graph):
        found[f"cycle inside {unit_of(component[0])}: {', '.join(component)}"] += cycle_lines(component, imports, str)
    return dict(found)


def cycle_lines(component: list[str], imports: Sequence[Import], node_of: Callable[[str], str | None]) -> list[str]:
    """The imports between members of one cycle, for its message."""
    members = set(component)
    return [
        f"{i.module}:{i.line} imports {i.target}"
        for i in imports
        if node_of(i.module) in members and node_of(i.target) in members and node_of(i.module) != node_of(i.target)
    ]


def report(found: dict[str, list[str]]) -> str:
    return "\n".join(f"- {key}\n    " + "\n    ".join(sorted(set(lines))) for key, lines in sorted(found.items()))


# --- the rules, on the package as it is -------------------------------------------------------------------------


def test_every_module_has_a_floor():
    unplaced = [m for m in package_modules() if floor_of(m) is None]
    assert not unplaced, f"modules missing from LAYERS in {__file__}: {unplaced}"


def test_imports_keep_the_rules():
    found = violations(package_imports())
    assert not found, "imports that break the floor plan (see this file's docstring for the rules):\n" + report(found)


def test_each_sideways_edge_is_used():
    units = {(unit_of(i.module), unit_of(i.target)) for i in package_imports()}
    unused = sorted(edge for edge in SIDEWAYS if edge not in units)
    assert not unused, f"SIDEWAYS entries no import uses: delete them from {__file__}: {unused}"


def test_floors_hold_few_units():
    crowded = [floor for floor in LAYERS if len(floor) > MAX_UNITS_PER_FLOOR]
    assert not crowded, f"floors with more than {MAX_UNITS_PER_FLOOR} units: split them by purpose: {crowded}"
    names = [name for floor in LAYERS for name in floor]
    assert len(names) == len(set(names)), "a name placed on two floors"


def test_the_top_level_holds_only_what_many_floors_share():
    loose = {path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    unexplained = sorted(loose - set(TOP_LEVEL))
    gone = sorted(set(TOP_LEVEL) - loose)
    assert not unexplained, (
        f"loose modules at the top of the package: {unexplained}. Fix: move each into the package it serves, "
        f"or, if several floors import it, add it to TOP_LEVEL in {__file__} saying which"
    )
    assert not gone, f"TOP_LEVEL names modules that are not at the top any more: delete them: {gone}"


# --- each rule fails when broken: the checks on imports added to the package's own -----------------------------


def with_added(module: str, target: str, name: str | None = None) -> dict[str, list[str]]:
    return violations([*package_imports(), Import(module, 999, target, name)])


def test_an_upward_import_is_caught_even_inside_a_function(tmp_path):
    path = tmp_path / "example.py"
    path.write_text("def f():\n    from asyncgrpo.rollout.collector import Collector\n", encoding="utf-8")
    (found,) = imports_of("generation.http", path, set(package_modules()))
    assert found == Import("generation.http", 2, "rollout.collector", "Collector")
    assert "upward: generation.http imports rollout.collector" in with_added("generation.http", "rollout.collector")


def test_an_import_under_type_checking_counts(tmp_path):
    path = tmp_path / "example.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from asyncgrpo import api\n", encoding="utf-8")
    assert imports_of("types", path, set(package_modules())) == [Import("types", 3, "api", None)]


def test_a_sideways_import_is_caught():
    assert "sideways: data -> generation" in with_added("data.loading", "generation.base", "Generator")
    assert "sideways: trl_names -> loss_config" not in with_added("data.loading", "generation.base", "Generator")


def test_a_cycle_between_units_is_caught():
    found = violations([Import("data.source", 1, "generation.base", None), Import("generation.base", 2, "data.source", None)])
    assert found["cycle between units: data, generation"] == ["data.source:1 imports generation.base", "generation.base:2 imports data.source"]
    # Through a sideways edge SIDEWAYS allows, too.
    found = violations([Import("trl_names", 1, "loss_config", None), Import("loss_config", 2, "trl_names", None)])
    assert "cycle between units: loss_config, trl_names" in found


def test_a_cycle_inside_a_unit_is_caught():
    found = violations([Import("rollout.buffer", 1, "rollout.collector", None), Import("rollout.collector", 2, "rollout.buffer", "Buffer")])
    assert list(found) == ["cycle inside rollout: rollout.buffer, rollout.collector"]


def test_another_units_private_name_is_caught():
    assert "private: rollout.collector imports generation.base._private" in with_added(
        "rollout.collector", "generation.base", "_private"
    )
    assert "private: rollout.collector imports rollout.buffer._private" not in with_added(
        "rollout.collector", "rollout.buffer", "_private"
    )


def test_only_the_python_api_sits_above_the_commands():
    assert floor_of("commands.train") == floor_of("commands.simulate") == floor_of("commands.cli") == len(LAYERS) - 2
    assert floor_of("api") == len(LAYERS) - 1

