"""`asyncgrpo train|simulate|check RECIPE [dotted.key=value ...]`, `asyncgrpo serve MODEL`, `asyncgrpo tune RUN_DIR` and
`asyncgrpo convert-trl FILE`:
argument parsing and exit codes only.

Exit codes: 0 completed, 1 failed (the run's diagnostic is printed), 2 stalled,
3 bad config (reported before any model loads), 130/143 interrupted by SIGINT/SIGTERM.
Errors are one paragraph on stderr; `--debug` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.api_config import Prepared, build_config
from asyncgrpo.errors import AsyncGRPOError, ConfigError

EXIT_CONFIG = 3

log = logging.getLogger("asyncgrpo")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncgrpo", description="Asynchronous GRPO training that never hangs and never loses a prompt.")
    sub = parser.add_subparsers(dest="command", required=True)

    def recipe_command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("recipe", help="YAML recipe, e.g. recipes/demo.yaml")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.max_steps=5")
        p.add_argument("--debug", action="store_true", help="show tracebacks")
        return p

    recipe_command("train", "Train a model with GRPO as the recipe says.")
    sim = recipe_command("simulate", "Run the recipe's pipeline on virtual time with a scripted backend and a stub trainer.")
    sim.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    sim.add_argument("--output-dir", type=Path, default=None, metavar="DIR",
                     help="also write metrics.jsonl and timeline.jsonl to DIR (virtual time), for `asyncgrpo plot DIR`")
    recipe_command("check", "Check a recipe, the files it names and its data (the tokenizer loads, the weights do not); print what the run would do.")
    plot = sub.add_parser("plot", help="Draw a run's metrics and pipeline timeline as PNGs.",
                          description="Draw a run's metrics and pipeline timeline as PNGs; series, panels and figures that "
                                      "carry no information are left out, each named with why.")
    plot.add_argument("run_dir", type=Path, help="a run directory (runs/<run.name>) or a `simulate --output-dir` directory")
    plot.add_argument("--out", type=Path, default=None, help="where the PNGs go (default RUN_DIR/plots)")
    plot.add_argument("--debug", action="store_true", help="show tracebacks")
    tune = sub.add_parser("tune", help="Calibrate the simulator from a run, check it replays the run, and recommend a config.",
                          description="Fit the simulator to a run directory (writes RUN_DIR/tuned.yaml), replay the run on virtual "
                                      "time and compare, then sweep staleness, policy, width and batch size and recommend a config.")
    tune.add_argument("run_dir", type=Path, help="the directory of a finished `asyncgrpo train` run (runs/<run.name>)")
    tune.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    tune.add_argument("--plot", action="store_true", help="draw the swept configs and their frontier to RUN_DIR/tune.png")
    tune.add_argument("--max-staleness", type=_bounded_int(0, 1 << 20), default=None, metavar="K",
                      help="recommend only configs with rollout.max_staleness <= K")
    tune.add_argument("--min-length-bias", type=_positive_float, default=None, metavar="B",
                      help="recommend only configs whose predicted length bias is at least B (e.g. 0.95)")
    tune.add_argument("--pool", type=Path, action="append", default=[], metavar="OTHER_RUN_DIR",
                      help="fit decode and trainer time to this run's timeline too (same model and backend, same machine; e.g. the "
                           "recipe at rollout.max_staleness=0 beside it): shows how much generation and training slow each other")
    tune.add_argument("--debug", action="store_true", help="show tracebacks")
    convert = sub.add_parser(
        "convert-trl",
        help="Convert a TRL GRPOConfig YAML/JSON into a recipe, reporting what was mapped and what has no counterpart.",
        description="Convert a TRL GRPOConfig-shaped YAML or JSON file into an asyncgrpo recipe (on stdout, or --out), "
        "with a report on stderr of what was mapped, what is already asyncgrpo's behaviour, and what has no counterpart and why.",
    )
    convert.add_argument("trl_config", type=Path, help="a YAML or JSON file of GRPOConfig fields (e.g. GRPOConfig.to_dict() dumped)")
    convert.add_argument("--out", type=Path, default=None, help="write the recipe here instead of stdout")
    convert.add_argument("--debug", action="store_true", help="show tracebacks")
    serve = sub.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API (vLLM's subset that generation.backend: http uses).",
        description="Serve a model over an OpenAI-compatible HTTP API (vLLM's subset that generation.backend: http "
        "uses), with the in-process engine. Stops on SIGINT/SIGTERM.",
    )
    serve.add_argument("model", help="a local Hugging Face model directory, a Hugging Face Hub id, or builtin:tiny")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; /collective_rpc loads any readable path, keep it private)"
    )
    serve.add_argument("--port", type=_bounded_int(0, 65535), default=8000, help="port to bind (default 8000; 0 picks a free one)")
    serve.add_argument("--max-batch-size", type=_bounded_int(1, 1 << 16), default=64, help="most sequences decoded together (default 64)")
    serve.add_argument("--served-model-name", default=None, help="model name clients must send (default: MODEL as given)")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype (default float32)")
    serve.add_argument("--seed", type=_bounded_int(0, 2**32 - 1), default=0, help="initialisation seed of builtin models (default 0)")
    serve.add_argument("--max-prompt-chars", type=_bounded_int(1, 1 << 40), default=None, metavar="N",
                       help="longest string prompt, refused (HTTP 400) before it is tokenised; the request body limit is "
                       "12 bytes per character of it plus 1 MiB (default: 16 characters per token of the model's maximum length)")
    serve.add_argument("--reload-timeout-s", type=_positive_float, default=300.0, metavar="S",
                       help="longest time reading the weights of one /collective_rpc reload_weights (default 300)")
    serve.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], else one line naming the limits."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value

    return parse


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0, else one line saying so."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value:g} is not a finite number > 0")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return _run_command(args)
    except ConfigError as exc:
        _report(exc, args.debug, prefix="config error: ")
        return EXIT_CONFIG
    except AsyncGRPOError as exc:
        _report(exc, args.debug, prefix="error: ")
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - no command ends in a raw traceback
        hint = "" if args.debug else ". Run the same command with --debug to see the traceback, and please report it."
        _report(exc, args.debug, prefix=f"error: unexpected {type(exc).__name__}: ", suffix=hint)
        return 1


def _run_command(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from asyncgrpo.commands.serve import serve_cli

        return serve_cli(args)
    if args.command == "plot":
        from asyncgrpo.commands.plot import plot_run

        plots = plot_run(args.run_dir, args.out)
        for path in plots.written:
            print(path)
        for note in plots.left_out:
            print(note)
        return 0
    if args.command == "tune":
        from asyncgrpo.commands.tune import tune_cli

        return tune_cli(args.run_dir, as_json=args.json, plot=args.plot, max_staleness=args.max_staleness,
                        min_length_bias=args.min_length_bias, pool=args.pool)
    if args.command == "convert-trl":
        return _convert_trl(args.trl_config, args.out)
    prepared = build_config(args.recipe, cli_overrides=args.overrides)  # the Python API's config, from a recipe
    algorithm_for(prepared.config)  # the algorithm's own rules on the recipe, before anything starts
    if args.command == "simulate":
        return _simulate(prepared, as_json=args.json, output_dir=args.output_dir)
    if args.command == "check":
        from asyncgrpo.commands.check import check_recipe

        print(check_recipe(prepared.config))
        print(f"{args.recipe}: ok")
        return 0
    from asyncgrpo.commands.run_training import run_training

    summary = run_training(prepared)
    print(summary.render(), file=sys.stderr)
    return summary.exit_code


def _convert_trl(source: Path, out: Path | None) -> int:
    """Convert, report on stderr, validate the recipe against the whole config, then print or write it."""
    from asyncgrpo.config import validate_config
    from asyncgrpo.trl_convert import convert_trl, load_trl_file

    conversion = convert_trl(load_trl_file(source))
    print(conversion.report(), file=sys.stderr)
    validate_config(conversion.recipe, f"the recipe converted from {source}")
    text = f"# converted from TRL's {source.name} by asyncgrpo convert-trl\n" + conversion.to_yaml()
    if out is None:
        print(text, end="")
    else:
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out}: check it with asyncgrpo check {out}", file=sys.stderr)
    return 0


def _simulate(prepared: Prepared, *, as_json: bool, output_dir: Path | None) -> int:
    from asyncgrpo.commands.simulate import simulate

    simulation = simulate(prepared.config, output_dir=output_dir)
    report = simulation.report()
    if as_json:
        print(json.dumps(report))
    else:
        print(_format_simulation(report))
    return simulation.exit_code


def _format_simulation(report: dict) -> str:
    acc = report["accounting"]
    dropped = ", ".join(f"{k} {v}" for k, v in acc["dropped"].items() if v) or "none"
    lines = [
        f"outcome: {report['outcome']} ({report['stop_reason']}) after {report['steps']} steps, "
        f"{report['virtual_time_s']:.1f} virtual s in {report['wall_time_s']:.2f} wall s",
        f"efficiency: {report['efficiency']:.2f} of the bound {report['capacity_bound_completions_per_s']:.2f} completions/s",
        f"tokens: efficiency {_maybe(report['token_efficiency'])}, goodput {_maybe(report['goodput'])}, "
        f"length bias {_maybe(report['length_bias'])}, wasted " + ", ".join(f"{k} {v}" for k, v in report["wasted_tokens"].items()),
        f"prompts: taken {acc['taken']}, trained {acc['trained']}, requeued {acc['requeued']}, dropped: {dropped}, "
        f"in flight at exit {acc['in_flight']}, buffered at exit {acc['buffered']}",
        f"max staleness trained: {report['staleness_max']}",
        "counters: " + ", ".join(f"{k.removeprefix('rollout/')} {v}" for k, v in report["counters"].items() if v),
    ]
    if report["error"]:
        lines.append(f"error ({report['error']['kind']}): {report['error']['message']}")
    return "\n".join(lines)


def _maybe(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _report(exc: BaseException, debug: bool, prefix: str, suffix: str = "") -> None:
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"{prefix}{exc}{suffix}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
