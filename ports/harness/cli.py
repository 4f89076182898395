"""``compare.py``: cross-validate every implementation against the float64 oracle, then time it.

Examples::

    python compare.py --list
    python compare.py --suite smoke
    python compare.py --shape 4x4096x32x128 --layout bshd --dtype bf16 fp32
    python compare.py --suite decode --graph --json results.json
    python compare.py --summary results.json --summary-value vs_compile
    python compare.py --suite peers --impl examples.my_rope:rope_half --json peers.json
    python compare.py --summary peers.json --summary-value vs_fastest

Exit status: 0 done, 1 a check failed, 2 bad input (one line on stderr says what and what would
be right), 3 the mode needs an NVIDIA GPU this machine lacks.

This module parses and checks the arguments without importing torch (``--help`` and argument
errors come back at once); :mod:`ports.harness.modes` does the work.
"""
from __future__ import annotations

import argparse
import difflib
import math
import shutil
import sys
import textwrap
from collections.abc import Sequence

from ports import _impl_target
from ports.harness import preflight
from ports.harness.metrics import SUMMARY_VALUES
from ports.registry import BACKENDS, FAMILIES, PEERS_WORD

# The choices, without importing torch; tests/test_cli_choices.py checks them against
# reference.vocabulary and ports.harness.suites.
STYLES = ("rotate_half", "interleaved")
LAYOUTS = ("sbhd", "bshd", "bhsd", "thd")
DTYPES = ("fp32", "fp16", "bf16", "fp64")
COS_SIN_DTYPES = ("fp32", "fp64", "same")
POSITION_KINDS = ("arange", "offset", "ids")
SUITES = ("smoke", "crossval", "leetcuda_table", "decode", "anchors", "prefill", "qkv", "partial",
          "interleaved", "positions", "varlen", "gqa", "long", "apex", "ablation", "peers",
          "serving", "te_sweep", "batch_reuse_sweep", "batch_reuse_sweep_full")
# Earlier suite names (named after the seed documents they come from), still accepted.
SUITE_ALIASES = {"seed000": "te_sweep", "seed001": "leetcuda_table", "seed002": "batch_reuse_sweep",
                 "seed002_full": "batch_reuse_sweep_full"}
MOVED_SUITES = {"seed004": "seed 004's RMSNorm + matmul + RoPE experiments are not RoPE cases: "
                           "run compare.py --pipeline"}
PIPELINE_EXPERIMENTS = ("rbe", "rmsnorm", "fused")  # ports.harness.pipeline.EXPERIMENTS
# The modes besides "run" (--shape/--suite, the default), each with the options it reads; an
# option no mode reads is refused rather than ignored.
MODE_OPTIONS = {"list": ("only", "skip", "json", "verbose", "impl"),
                "summary": ("summary_value",),
                "design": ("only", "skip", "verbose", "impl"),
                "overhead": (),
                "accuracy": ("only", "skip", "dtype", "seed", "plot", "impl", "verbose"),
                "claims": (),
                "pipeline": ("seed",)}
MODES = tuple(MODE_OPTIONS)
ANY_MODE = ("no_progress",)
# What builds a --shape case; the suites fix their own.
SHAPE_OPTIONS = ("layout", "dtype", "style", "rotary_dim", "positions", "cos_sin_dtype", "base",
                 "kv_heads", "strided", "seqlens")

USAGE = ("compare.py [--shape AxBxCxD | --suite NAME] [options]\n"
         "       compare.py --list | --summary F | --design [F] | --accuracy | --claims | "
         "--pipeline | --overhead")
HELP_WIDTH = 100  # --help wraps at the terminal's width, at most this (output stays <= 140)
EXIT_NEEDS_GPU = 3


class Parser(argparse.ArgumentParser):
    """Errors are one line on stderr (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"compare.py: error: {message} (see compare.py --help)\n")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"4x4096x32x128"`` -> four positive ints (in the layout's own order)."""
    parts = text.lower().replace("×", "x").split("x")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) != 4 or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(
            f"malformed shape {text!r}: expected four positive ints joined by 'x' in the "
            "layout's order, e.g. 4x4096x32x128 for bshd (b x s x h x d)")
    return dims  # type: ignore[return-value]


def suite_name(text: str) -> str:
    text = SUITE_ALIASES.get(text, text)
    if text in MOVED_SUITES:
        raise argparse.ArgumentTypeError(MOVED_SUITES[text])
    if text not in SUITES:
        close = difflib.get_close_matches(text, SUITES, n=3)
        raise argparse.ArgumentTypeError(
            f"unknown suite {text!r}" + (f"; closest: {', '.join(close)}" if close else "")
            + f"; suites: {', '.join(SUITES)}")
    return text


def impl_target(text: str) -> str:
    """``module:function``, its module found but not imported (the mode imports it)."""
    problem = _impl_target.problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return text


def _number(kind, low: float, what: str):
    """An argparse type: ``kind`` (int or float) > ``low``, finite."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not value > low:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


POSITIVE_INT = _number(int, 0, "a positive integer")
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes


def seed_value(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a seed: an integer from -2**63 to 2**64 - 1")
    return value


def _formatter(prog: str) -> argparse.HelpFormatter:
    """The epilog as written; the options wrapped at the terminal's width, at most HELP_WIDTH."""
    width = min(shutil.get_terminal_size().columns, HELP_WIDTH) - 2
    return argparse.RawDescriptionHelpFormatter(prog, width=width)


def build_parser() -> Parser:
    epilog = textwrap.fill(
        f"Implementations are selected by name (compare.py --list), by family "
        f"({', '.join(FAMILIES)}), by backend ({', '.join(BACKENDS)}) or as '{PEERS_WORD}' "
        "(the production libraries and your --impl rows).", 100) + "\n\n" + \
        textwrap.fill("Exit status: 0 done, 1 a check failed, 2 bad input, 3 the mode needs an "
                      "NVIDIA GPU this machine lacks.", 100)
    p = Parser(prog="compare.py", usage=USAGE, epilog=epilog,
               description="Cross-validate every RoPE implementation against a float64 oracle, "
                           "then time it (on an NVIDIA GPU).",
               formatter_class=_formatter)
    what = p.add_argument_group("what to run")
    what.add_argument("--shape", type=parse_shape, action="append", metavar="AxBxCxD",
                      help="shape in the layout's order, e.g. 4x4096x32x128 with --layout bshd "
                           "(repeatable); thd takes b x s x h x d (b sequences of <= s tokens)")
    what.add_argument("--suite", action="append", type=suite_name, metavar="NAME",
                      help="a named set of cases (repeatable): " + ", ".join(SUITES))
    what.add_argument("--layout", choices=LAYOUTS, default="bshd")
    what.add_argument("--dtype", nargs="+", choices=DTYPES, default=["fp32"])
    what.add_argument("--style", nargs="+", choices=STYLES, default=["rotate_half"],
                      help="rotate_half (NeoX/HF: pairs i, i+R/2) or interleaved (GPT-J: 2i, 2i+1)")
    what.add_argument("--rotary-dim", type=POSITIVE_INT, default=None, metavar="R",
                      help="rotate the first R <= head dim channels, R even (default: all)")
    what.add_argument("--positions", choices=POSITION_KINDS, default="arange")
    what.add_argument("--cos-sin-dtype", choices=COS_SIN_DTYPES, default="fp32")
    what.add_argument("--base", type=_number(float, 0, "a positive, finite RoPE base"),
                      default=10000.0, help="the angle base theta (> 0; default 10000)")
    what.add_argument("--kv-heads", type=POSITIVE_INT, default=None,
                      help="also rotate a k with this many heads")
    what.add_argument("--strided", action="store_true", help="cut x out of a packed qkv tensor")
    what.add_argument("--seqlens", type=POSITIVE_INT, nargs="+",
                      help="--layout thd: the b sequence lengths, each <= s")
    what.add_argument("--backward", action="store_true", help="also run the backward direction")
    what.add_argument("--backward-only", action="store_true",
                      help="run the backward direction alone (of --shape and --suite cases)")
    what.add_argument("--seed", type=seed_value, default=0)
    which = p.add_argument_group("which implementations")
    which.add_argument("--only", nargs="+", metavar="NAME",
                       help="names, families or backends to run")
    which.add_argument("--skip", nargs="+", metavar="NAME",
                       help="names, families or backends to leave out")
    which.add_argument("--impl", action="append", type=impl_target, metavar="MODULE:FUNCTION",
                       help="add your own function as a row, named user.FUNCTION (repeatable; "
                            "README: 'Your own kernel as a row'); installed packages' "
                            "rope_ports.impls entry points are added too")
    modes = p.add_argument_group("other modes (one at a time)")
    modes.add_argument("--list", action="store_true", help="print the registry and exit")
    modes.add_argument("--summary", metavar="RESULTS_JSON",
                       help="pivot a --json results file: implementations x cases")
    modes.add_argument("--summary-value", default="pct_copy", choices=SUMMARY_VALUES,
                       metavar="VALUE", help="the value --summary pivots (default pct_copy): "
                                             + ", ".join(SUMMARY_VALUES))
    modes.add_argument("--design", nargs="?", const="", metavar="RESULTS_JSON",
                       help="print the design-notes table; with a --json results file of the "
                            "prefill suite, add each implementation's median %% of copy")
    modes.add_argument("--claims", action="store_true",
                       help="measure every quantitative claim of the seeds (needs a GPU)")
    modes.add_argument("--pipeline", nargs="*", choices=PIPELINE_EXPERIMENTS, metavar="EXPERIMENT",
                       help="seed 004's RMSNorm + matmul + RoPE experiments (kernl): "
                            f"{', '.join(PIPELINE_EXPERIMENTS)} (default: all); needs a GPU to "
                            "time, validates a tiny shape on the CPU")
    modes.add_argument("--accuracy", action="store_true",
                       help="max error against the float64 ideal by position bucket (up to 128k)")
    modes.add_argument("--overhead", action="store_true",
                       help="benchmark the adapter's host time per call (needs a GPU)")
    out = p.add_argument_group("output")
    out.add_argument("--json", nargs="?", const="-", metavar="PATH",
                     help="write results (or, with --list, the registry) as JSON; no PATH: stdout")
    out.add_argument("--csv", nargs="?", const="-", metavar="PATH", help="write results as CSV")
    out.add_argument("--graph", action="store_true",
                     help="also time CUDA-graph replays (a backward: the backward alone, "
                          "captured on the stream its forward ran on)")
    out.add_argument("--plot", metavar="PATH", help="write a plot (PNG): GB/s against tokens "
                     "(needs a GPU), or with --accuracy error against position")
    out.add_argument("--verbose", action="store_true",
                     help="a full row for every implementation, unsupported ones included; "
                          "with --list and --design, one line per row (markdown)")
    out.add_argument("--keep-going", action="store_true",
                     help="run every case even after one fails (exit status still 1)")
    out.add_argument("--no-progress", action="store_true")
    return p


def mode_of(args) -> str:
    """The one mode the arguments ask for ("run" unless a mode flag is given)."""
    given = [m for m in MODES if getattr(args, m) not in (None, False)]
    if len(given) > 1:
        raise ValueError(f"--{given[0]} and --{given[1]} are separate modes: give one")
    return given[0] if given else "run"


def check_options(args, parser: argparse.ArgumentParser, mode: str) -> None:
    """Refuse an option the mode does not read (ValueError), rather than ignore it."""
    if mode == "run" and not args.shape:
        unread, where = {"summary_value", *SHAPE_OPTIONS}, "--suite (it fixes its own cases)"
    elif mode == "run":  # a --shape run reads every option but the other modes' own
        unread, where = {"summary_value"}, "--shape/--suite runs"
    else:
        unread = set(vars(args)) - {mode, *MODE_OPTIONS[mode], *ANY_MODE}
        where = f"--{mode}"
    given = sorted(o for o in unread if getattr(args, o) != parser.get_default(o))
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag} does not apply to {where}; leave it out")


def check_args(args) -> None:
    """Refuse values no case can take, with what would be right (ValueError)."""
    if args.seqlens and args.layout != "thd":
        raise ValueError("--seqlens sets the sequence lengths of --layout thd (packed "
                         f"sequences); --layout {args.layout} has none")
    if args.seqlens and not args.shape:
        raise ValueError("--seqlens needs a --shape b x s x h x d with --layout thd")
    if args.rotary_dim is not None and args.rotary_dim % 2:
        raise ValueError(f"--rotary-dim {args.rotary_dim} must be even (RoPE rotates pairs)")
    for dims in args.shape or ():
        shape, head_dim = "x".join(map(str, dims)), dims[3]
        if head_dim % 2:
            raise ValueError(f"--shape {shape}: head dim {head_dim} must be even (RoPE rotates "
                             "pairs of channels)")
        if args.rotary_dim is not None and args.rotary_dim > head_dim:
            raise ValueError(f"--rotary-dim {args.rotary_dim} must be <= the head dim "
                             f"({head_dim} in --shape {shape})")
        if args.seqlens and (len(args.seqlens) != dims[0] or max(args.seqlens) > dims[1]):
            raise ValueError(f"--seqlens takes b = {dims[0]} lengths, each <= s = {dims[1]} "
                             f"(--shape {shape} is b x s x h x d for thd)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        mode = mode_of(args)
        check_options(args, parser, mode)
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    # Before any work (and before torch is imported), not after the whole run.
    reads = {"summary": args.summary, "design": args.design or None}.get(mode)
    problems = [preflight.plot_problem(args.plot),
                *(preflight.output_problem(f"--{flag}", getattr(args, flag), flag != "plot")
                  for flag in ("json", "csv", "plot")),
                reads and preflight.results_file_problem(f"--{mode}", reads)]
    problem = next((p for p in problems if p), None)
    if problem:
        parser.error(problem)

    from ports.harness import modes

    try:
        return modes.MODES[mode](args)
    except modes.UsageError as exc:
        parser.error(str(exc))
    except modes.NeedsGPU as exc:
        print(f"compare.py: {exc}", file=sys.stderr)
        return EXIT_NEEDS_GPU
