"""The ``atom-hybrid-cache`` console script.

    atom-hybrid-cache replay [TRACES ...] [options]   replay traces through the policies
    atom-hybrid-cache diagnose LOG                    say which cache pool binds
    atom-hybrid-cache advise [TRACES ...] --model NAME --memory-gib G
                                                      the settings to serve TRACES with

``replay`` only parses and validates its arguments here, then hands the
namespace to ``atom_hybrid_cache.replay.runner.run_replay`` (imported when the
subcommand runs, so ``diagnose`` works without the replay stack).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, Sequence

from atom_hybrid_cache import __version__

DEFAULT_MODEL = "qwen3.5-27b"
DEFAULT_PLOT = "replay_sweep.png"


# --------------------------------------------------------------------------
# Argument types. A type that raises ArgumentTypeError makes argparse call
# parser.error with "argument --flag: <message>", so the flag is named.
# --------------------------------------------------------------------------


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            what = "positive" if minimum == 1 else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    convert.__name__ = "int"
    return convert


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def interval_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < -1:
        raise argparse.ArgumentTypeError(
            f"must be > 0 (a rung every N tokens), 0 (checkpointing off) or -1 (no ladder), got {value}")
    return value


def policy_list(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of policies, got {text!r}")
    return names


def slot_list(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
    values = [non_negative_int(p) for p in parts]
    return sorted(set(values))


# --------------------------------------------------------------------------
# Parsers
# --------------------------------------------------------------------------


def add_replay_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``replay`` flags to ``parser`` and return it."""
    parser.add_argument(
        "traces",
        nargs="*",
        metavar="TRACE",
        help="trace files or folders (cc-traces JSON, Mooncake JSONL); none = the embedded sample",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency", metavar="N", type=positive_int, default=8,
        help="requests in flight at once (default: %(default)s)",
    )
    load.add_argument(
        "--max-requests", metavar="N", type=positive_int, default=None,
        help="stop after this many requests, for quick runs (default: all)",
    )
    load.add_argument(
        "--prefill-chunk", metavar="N", type=positive_int, default=8192,
        help="prefill tokens per scheduler step (default: %(default)s)",
    )
    load.add_argument(
        "--num-spec", metavar="N", type=non_negative_int, default=0,
        help="speculative tokens per decode step (default: %(default)s)",
    )
    load.add_argument(
        "--time-scale", metavar="X", type=non_negative_float, default=0.0,
        help="client clock: a conversation sends its next turn at the previous one's "
             "completion + min(think time, --think-cap-s) x X, sub-agents run as extra lanes "
             "while their parent waits; 0: saturated, every turn at once (a bound) "
             "(default: %(default)s)",
    )
    load.add_argument(
        "--think-cap-s", metavar="S", type=non_negative_float, default=600.0,
        help="the cap on one think time (default: %(default)s)",
    )
    load.add_argument(
        "--prefill-tokens-per-s", metavar="N", type=positive_float, default=10_000.0,
        help="with --time-scale: a step's prefill speed (default: %(default)s)",
    )
    load.add_argument(
        "--decode-step-ms", metavar="MS", type=non_negative_float, default=30.0,
        help="with --time-scale: a decode step's time (default: %(default)s)",
    )
    load.add_argument(
        "--replayssm", action="store_true",
        help="with --num-spec: one state slot per request holding ReplaySSM's records "
             "(ATOM_ENABLE_REPLAYSSM=1), instead of 1 + num-spec slots",
    )

    geo = parser.add_argument_group("geometry")
    geo.add_argument(
        "--model", metavar="NAME", default=DEFAULT_MODEL,
        help="geometry preset name (default: %(default)s)",
    )
    geo.add_argument(
        "--memory-gib", metavar="GIB", type=positive_float, default=80.0,
        help="GPU memory for the KV and state pools, GiB (default: %(default)s)",
    )
    geo.add_argument(
        "--block-size", metavar="N", type=positive_int, default=64,
        help="KV block size in tokens (default: %(default)s)",
    )
    geo.add_argument(
        "--kv-bytes-per-token", metavar="N", type=positive_int, default=None,
        help="override the preset: KV bytes per token over all attention layers",
    )
    geo.add_argument(
        "--state-slot-bytes", metavar="N", type=positive_int, default=None,
        help="override the preset: bytes of one recurrent state slot over all linear layers",
    )
    geo.add_argument(
        "--max-model-len", metavar="N", type=positive_int, default=None,
        help="override the preset: context length; longer requests are counted apart",
    )

    pol = parser.add_argument_group("policies")
    pol.add_argument(
        "--policies", metavar="LIST", type=policy_list, default=["all"],
        help="comma-separated policy names, or 'all' (default: all)",
    )
    pol.add_argument(
        "--state-checkpoint-slots", metavar="N", type=non_negative_int, default=None,
        help="state slots that can hold checkpoints (default: the project default)",
    )
    pol.add_argument(
        "--interval", metavar="N", type=interval_int, default=None,
        help="state checkpoint interval in tokens: >0 a rung every N, 0 off, -1 no ladder (default: the project default)",
    )
    pol.add_argument(
        "--sweep-slots", metavar="LIST", type=slot_list, default=None,
        help="comma-separated checkpoint headroom slot counts to sweep, e.g. 0,8,32,128",
    )

    pol.add_argument(
        "--sweep-memory", metavar="LIST", type=gib_list, default=None,
        help="comma-separated memory sizes in GiB: the plugin (default) against vLLM's own "
             "caching (vllm-align) at each, plotted to --plot, e.g. 20,40,80",
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--plot", default=DEFAULT_PLOT, metavar="PATH",
        help="PNG for the --sweep-slots or --sweep-memory plot (default: %(default)s)",
    )
    out.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument(
        "--jobs", metavar="N", type=positive_int, default=2,
        help="worker processes for policies and sweep points (default: %(default)s)",
    )
    return parser


def gib_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of GiB > 0, got {text!r}")
    return values


def model_name(text: str) -> str:
    from atom_hybrid_cache.replay.geometry import GEOMETRY_PRESETS
    if text not in GEOMETRY_PRESETS:
        raise argparse.ArgumentTypeError(
            f"unknown model {text!r}; known: {', '.join(sorted(GEOMETRY_PRESETS))}")
    return text


def add_advise_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``advise`` flags to ``parser`` and return it."""
    parser.add_argument(
        "traces", nargs="*", metavar="TRACE",
        help="trace files or folders (cc-traces JSON), at least 2 traces; none = the embedded sample",
    )
    parser.add_argument("--model", metavar="NAME", type=model_name, required=True,
                        help="geometry preset name, e.g. qwen3.5-27b, qwen3-next-80b")
    parser.add_argument("--memory-gib", metavar="GIB", type=positive_float, required=True,
                        help="GPU memory for the KV and state pools, GiB")
    parser.add_argument("--concurrency", metavar="N", type=positive_int, default=8,
                        help="requests in flight at once (default: %(default)s)")
    parser.add_argument("--prefill-chunk", metavar="N", type=positive_int, default=8192,
                        help="prefill tokens per scheduler step (default: %(default)s)")
    parser.add_argument("--time-scale", metavar="X", type=non_negative_float, default=0.0,
                        help="client clock, as replay's: the next turn at the previous one's "
                             "completion + min(think time, 600 s) x X; 0: saturated, every "
                             "turn at once (default: %(default)s)")
    parser.add_argument("--jobs", metavar="N", type=positive_int, default=2,
                        help="worker processes (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atom-hybrid-cache",
        description="Prefix caching for hybrid linear-attention models: replay and diagnose.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    replay = sub.add_parser(
        "replay",
        help="replay request traces through the caching policies",
        description="Replay request traces through the caching policies and compare hit rates.",
    )
    add_replay_arguments(replay)
    replay.set_defaults(handler=_run_replay)

    diag = sub.add_parser(
        "diagnose",
        help="read a log's cache stats lines and say which pool binds",
        description="Read the last complete set of cache stats lines in LOG and say which pool binds.",
    )
    diag.add_argument("log", metavar="LOG", help="log file to read ('-' for stdin)")
    diag.set_defaults(handler=_run_diagnose)

    try:
        from atom_hybrid_cache.replay.advise_grid import GRID_HELP
    except ImportError:     # the replay stack is optional for `diagnose`
        GRID_HELP = "see atom_hybrid_cache/replay/advise_grid.py."
    adv = sub.add_parser(
        "advise",
        help="sweep the plugin's settings through the replay planner and print the serve command",
        description="Run a grid of the plugin's settings through the replay planner's default "
                    "policy (the plugin as it runs in vLLM) on TRACES and their two halves, and "
                    "print the `vllm serve` command with the ATOM_* variables to use, the hit "
                    "rate to expect and the defaults'. Grid: " + GRID_HELP,
    )
    add_advise_arguments(adv)
    adv.set_defaults(handler=_run_advise)
    return parser


# --------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------

_RUNNER = "atom_hybrid_cache.replay.runner"


def _run_replay(args: argparse.Namespace) -> int:
    try:
        from atom_hybrid_cache.replay.runner import run_replay
    except ModuleNotFoundError as exc:
        # Only a missing runner is reported here; a missing dependency inside
        # the runner is a real error and keeps its traceback.
        if exc.name != _RUNNER:
            raise
        print(f"atom-hybrid-cache replay: {_RUNNER} is not available", file=sys.stderr)
        return 2
    try:
        return int(run_replay(args) or 0)
    except (OSError, ValueError) as exc:
        # Bad input (a trace that does not parse, an unknown policy or model,
        # a budget too small for the state slots): one line naming it.
        print(f"atom-hybrid-cache replay: {exc}", file=sys.stderr)
        return 2


def _run_advise(args: argparse.Namespace) -> int:
    from atom_hybrid_cache.replay.advise_output import run_advise
    try:
        return int(run_advise(args) or 0)
    except (OSError, ValueError) as exc:
        # a trace that does not parse, a set too small to halve, a budget
        # too small for the pool: one line naming it
        print(f"atom-hybrid-cache advise: {exc}", file=sys.stderr)
        return 2


def _run_diagnose(args: argparse.Namespace) -> int:
    from atom_hybrid_cache.diagnose import diagnose

    try:
        if args.log == "-":
            text = sys.stdin.read()
        else:
            with open(args.log, encoding="utf-8", errors="replace") as f:
                text = f.read()
        result = diagnose(text)
    except (OSError, ValueError) as exc:
        print(f"atom-hybrid-cache diagnose: {exc}", file=sys.stderr)
        return 2
    for line in result.lines:
        print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
