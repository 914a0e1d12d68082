"""Every import points down the pipeline: no module imports from a layer above its own.

The layers follow the data: prompts are loaded (data), completed (generation), scored
(rewards), collected into groups (rollout), trained on (training), in one loop (pipeline,
with evaluation beside it), reported (telemetry), wired into a run (wiring), behind the commands
(entry points, with the run directory's files). The ground floor holds what every
layer shares. A module may import its own layer and the layers below; the test reads every
import statement (those inside functions and `if TYPE_CHECKING:` blocks too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import asyncgrpo

PACKAGE = Path(asyncgrpo.__file__).parent

# Bottom first. A name is a module or a package (its modules); the longest match wins.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "types", "sync", "threads", "gc_pauses", "atomic", "vtime", "tasks", "loss_config", "config", "trl_names", "rundir",
     "signals", "watchdog", "objects", "user_modules", "worker_process", "telemetry.keys", "sampling"),
    ("data", "models"),
    ("generation",),
    ("rewards",),
    ("environments",),
    ("rollout", "distill", "algorithms.base"),  # distill: the pure judge and the simulated teacher; the algorithm protocol
    # algorithms: each implementation uses rollout's judge, distill's teacher and loss; the trainer imports the registry.
    ("training", "distill.teacher", "distill.loss", "algorithms"),
    ("pipeline", "evaluation"),
    ("telemetry",),
    ("wiring",),  # one place that wires a run, for the commands, the benchmarks and the tests
    ("commands", "run_files", "plot", "plot_timeline", "check", "trl_convert", "cli", "api", "api_config", "api_run"),
)


def layer_of(module: str) -> int | None:
    """The layer of `module` (dotted, without the `asyncgrpo.` prefix), or None if the table does not place it."""
    best: tuple[int, int] | None = None  # (length of the matching name, layer)
    for index, names in enumerate(LAYERS):
        for name in names:
            if module == name or module.startswith(name + "."):
                if best is None or len(name) > best[0]:
                    best = (len(name), index)
    return None if best is None else best[1]


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            modules[".".join(parts)] = path
    return modules


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every asyncgrpo module `path` imports, wherever the import statement is."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import; asyncgrpo imports are absolute")
            base = node.module or ""
            # `from asyncgrpo.training import checkpoint` imports a module; `from asyncgrpo.types import X` a name.
            package_dir = PACKAGE / base.removeprefix("asyncgrpo.").replace(".", "/")
            names = [
                f"{base}.{alias.name}" if base == "asyncgrpo" or (package_dir / f"{alias.name}.py").exists() else base
                for alias in node.names
            ]
        else:
            continue
        found += [(node.lineno, name.removeprefix("asyncgrpo.")) for name in names if name.startswith("asyncgrpo.")]
    return found


def test_every_module_has_a_layer():
    unplaced = [m for m in package_modules() if layer_of(m) is None]
    assert not unplaced, f"modules missing from LAYERS in {__file__}: {unplaced}"


def test_no_module_imports_from_a_layer_above_it():
    upward = []
    for module, path in package_modules().items():
        own = layer_of(module)
        assert own is not None
        for line, target in imported_modules(path):
            theirs = layer_of(target)
            assert theirs is not None, f"{module} (line {line}) imports {target}, which is not an asyncgrpo module"
            if theirs > own:
                upward.append(f"{module}:{line} imports {target} (layer {LAYERS[theirs]} is above {LAYERS[own]})")
    assert not upward, "imports pointing up the pipeline:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import_inside_a_function(tmp_path):
    path = tmp_path / "example.py"
    path.write_text("def f():\n    from asyncgrpo.rollout.collector import Collector\n", encoding="utf-8")
    assert imported_modules(path) == [(2, "rollout.collector")]
    assert layer_of("rollout.collector") > layer_of("generation.http")
    assert layer_of("telemetry.keys") == 0 and layer_of("telemetry.metrics") == len(LAYERS) - 3
