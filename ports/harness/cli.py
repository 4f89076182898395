"""``compare.py``: cross-validate every implementation against the float64 oracle, then time it.

Examples::

    python compare.py --list
    python compare.py --shape 4x4096x32x128 --layout bshd --dtype bf16 fp32
    python compare.py --suite seed001
    python compare.py --suite decode --graph --json results.json
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Sequence

from reference.case import COS_SIN_DTYPES, DTYPES, POSITION_KINDS, RopeCase
from reference.layouts import LAYOUTS
from reference.tables import STYLES

CPU_NOTE = ("No CUDA GPU found: cross-validating what runs on the CPU (the eager references, and "
            "Triton ports under TRITON_INTERPRET=1) on the given shapes. Timing and the CuPy "
            "ports need an NVIDIA GPU.")


PIPELINE_SUITE = "seed004"  # not RoPE cases: kernl's fused projection (ports.harness.pipeline)


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


def uneven_seqlens(batch: int, max_len: int, seed: int) -> tuple[int, ...]:
    """Deterministic uneven lengths in [1, max_len], the longest exactly max_len."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, max_len) for _ in range(batch)]
    lengths[rng.randrange(batch)] = max_len
    return tuple(lengths)


def case_from_shape(dims: tuple[int, int, int, int], layout: str, seed: int = 0,
                    seqlens: Sequence[int] | None = None, **fields) -> RopeCase:
    """A case from a shape in ``layout``'s order (thd takes b x s x h x d: b sequences <= s)."""
    order = "bshd" if layout == "thd" else layout
    size = dict(zip(order, dims))
    if layout == "thd":
        fields["seqlens"] = tuple(seqlens) if seqlens else uneven_seqlens(size["b"], size["s"], seed)
    return RopeCase(size["b"], size["s"], size["h"], size["d"], layout=layout, **fields)


def build_parser() -> argparse.ArgumentParser:
    from ports.harness.suites import SUITES

    p = argparse.ArgumentParser(
        prog="compare.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("what to run")
    what.add_argument("--shape", type=parse_shape, action="append", metavar="AxBxCxD",
                      help="shape in the layout's order, e.g. 4x4096x32x128 with --layout bshd "
                           "(repeatable); thd takes b x s x h x d (b sequences of <= s tokens)")
    what.add_argument("--suite", action="append", choices=sorted([*SUITES, PIPELINE_SUITE]),
                      help="a named set of cases (repeatable): " + ", ".join(SUITES)
                      + f"; {PIPELINE_SUITE} runs seed 004's RMSNorm/matmul/RoPE experiments")
    what.add_argument("--layout", choices=LAYOUTS, default="bshd")
    what.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["fp32"])
    what.add_argument("--style", nargs="+", choices=STYLES, default=["rotate_half"],
                      help="rotate_half (NeoX/HF: pairs i, i+R/2) or interleaved (GPT-J: 2i, 2i+1)")
    what.add_argument("--rotary-dim", type=int, default=None, help="R <= head_dim (default: all)")
    what.add_argument("--positions", choices=POSITION_KINDS, default="arange")
    what.add_argument("--cos-sin-dtype", choices=COS_SIN_DTYPES, default="fp32")
    what.add_argument("--base", type=float, default=10000.0)
    what.add_argument("--kv-heads", type=int, default=None, help="also rotate a k with this many heads")
    what.add_argument("--strided", action="store_true", help="cut x out of a packed qkv tensor")
    what.add_argument("--seqlens", type=int, nargs="+", help="thd: the sequence lengths")
    what.add_argument("--backward", action="store_true", help="also run the backward direction")
    what.add_argument("--backward-only", action="store_true",
                      help="run the backward direction alone (of --shape and --suite cases)")
    what.add_argument("--seed", type=int, default=0)
    which = p.add_argument_group("which implementations")
    which.add_argument("--only", nargs="+", metavar="NAME", help="names or families to run")
    which.add_argument("--skip", nargs="+", metavar="NAME", help="names or families to leave out")
    which.add_argument("--list", action="store_true", help="print the registry and exit")
    which.add_argument("--summary", metavar="RESULTS_JSON",
                       help="pivot a --json results file: implementations x cases")
    which.add_argument("--summary-value", default="pct_copy",
                       choices=["pct_copy", "pct_size_copy", "median_us", "graph_us", "gbps",
                                "err_over_tol", "vs_compile", "graph_vs_compile"])
    which.add_argument("--design", nargs="?", const="", metavar="RESULTS_JSON",
                       help="print the design-notes table; with a --json results file of the "
                            "prefill suite, add each implementation's median %% of copy")
    out = p.add_argument_group("output")
    out.add_argument("--json", nargs="?", const="-", metavar="PATH",
                     help="write results (or, with --list, the registry) as JSON; no PATH: stdout")
    out.add_argument("--csv", nargs="?", const="-", metavar="PATH", help="write results as CSV")
    out.add_argument("--graph", action="store_true", help="also time CUDA-graph replays (forward cases)")
    out.add_argument("--plot", metavar="PATH", help="write a plot (PNG): GB/s against tokens, or "
                     "with --accuracy error against position")
    out.add_argument("--claims", action="store_true",
                     help="measure every quantitative claim of the seeds (needs a GPU)")
    out.add_argument("--accuracy", action="store_true",
                     help="max error against the float64 ideal by position bucket (up to 128k)")
    out.add_argument("--keep-going", action="store_true",
                     help="run every case even after one fails (exit status still 1)")
    out.add_argument("--no-progress", action="store_true")
    out.add_argument("--overhead", action="store_true",
                     help="benchmark the adapter's host time per call and exit")
    return p


def cases_from_args(args) -> list[RopeCase]:
    from ports.harness.suites import get_suite

    cases: list[RopeCase] = []
    for name in args.suite or ():
        cases += get_suite(name)
    directions = (["backward"] if args.backward_only
                  else ["forward", "backward"] if args.backward else ["forward"])
    for dims in args.shape or ():
        for dtype in args.dtype:
            for style in args.style:
                for direction in directions:
                    cases.append(case_from_shape(
                        dims, args.layout, args.seed, args.seqlens, dtype=dtype, style=style,
                        rotary_dim=args.rotary_dim, positions=args.positions,
                        cos_sin_dtype=args.cos_sin_dtype, base=args.base,
                        kv_heads=args.kv_heads, contiguous=not args.strided,
                        direction=direction))
    if args.suite and (args.backward or args.backward_only):
        suite_cases = [c for c in cases if c.direction == "forward" and args.shape is None]
        backward = [c.replace(direction="backward") for c in suite_cases]
        if args.backward_only:  # the suites' own backward cases, then the converted ones
            cases = [c for c in cases if c.direction == "backward"] + backward
        else:
            cases += backward
    return cases


def _emit(text: str, path: str) -> None:
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}", file=sys.stderr)


def _accuracy(args, specs, env) -> int:
    from ports.harness import accuracy

    from ports.harness import preflight

    targets = env.targets()
    max_position = accuracy.MAX_POSITION
    if not env.has_gpu():
        # The Triton interpreter would take hours over 128k positions: references only, and
        # positions up to CPU_MAX_POSITION.
        targets = frozenset({"cpu"})
        max_position = preflight.CPU_MAX_POSITION
        print("No CUDA GPU found: measuring accuracy of what runs on the CPU (the eager "
              f"references) at positions up to {max_position:,} (128k on a GPU). The CuPy and "
              "Triton ports need an NVIDIA GPU.\n")
    dtypes = args.dtype if args.dtype != ["fp32"] else ["fp32", "bf16", "fp16"]
    rows = accuracy.measure(specs, dtypes=dtypes, targets=targets, device=env.device(),
                            seed=args.seed, max_position=max_position)
    print("## max |out - float64 ideal| by position (b=1, h=1, d=128, positions "
          f"0..{max_position - 1})")
    print(accuracy.table(rows, max_position))
    if args.plot:
        accuracy.plot(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from ports.harness import preflight

    problem = preflight.plot_problem(args.plot)
    if problem:
        parser.exit(2, f"compare.py: {problem}\n")

    import torch

    if not torch.cuda.is_available():
        # Triton reads this when a kernel is defined: set it before the ports are imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from ports import registry
    from ports.harness import env, report

    try:
        specs = registry.select(args.only, args.skip)
    except KeyError as exc:
        parser.error(str(exc.args[0]))

    if args.list:
        if not args.only and not args.skip:  # the listing names ablations (run only when named)
            specs += [s for s in registry.REGISTRY if s.kind == "ablation"]
        if args.json:
            _emit(report.to_json([report.spec_dict(s) for s in specs]), args.json)
        else:
            print(report.registry_table(specs))
        return 0
    if args.summary:
        import json

        with open(args.summary) as f:
            print(report.summary_table(json.load(f), args.summary_value))
        return 0
    if args.design is not None:
        pct = None
        if args.design:
            import json

            with open(args.design) as f:
                pct = report.prefill_pct_copy(json.load(f))
        print(report.design_table(specs, pct))
        return 0
    if args.overhead:
        from ports.harness.overhead import main as overhead_main

        return overhead_main()

    if args.accuracy:
        return _accuracy(args, specs, env)
    if args.claims:
        from ports.harness import claims

        if not env.has_gpu():
            rows = claims.unmeasured("needs an NVIDIA GPU: the claims are timings")
            print("No CUDA GPU found: --claims times kernels and needs an NVIDIA GPU. "
                  "The claims it would measure:\n")
        else:
            rows = claims.measure()
        print(claims.table(rows, env.metadata()["gpu"]))
        return 0

    pipeline_status = None
    if args.suite and PIPELINE_SUITE in args.suite:
        from ports.harness.pipeline import main_pipeline

        args.suite = [s for s in args.suite if s != PIPELINE_SUITE]
        pipeline_status = main_pipeline(["--seed", str(args.seed)])
        if not args.suite and not args.shape:
            return pipeline_status
    try:
        cases = cases_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not cases:
        parser.error("nothing to run: give --shape or --suite (or --list)")
    if not env.has_gpu():
        too_big = preflight.over_cpu_cap(cases)
        if len(too_big) == len(cases):
            parser.exit(2, f"compare.py: {preflight.cpu_refusal(too_big)}\n")
        if too_big:
            print(preflight.cpu_skip_note(too_big), file=sys.stderr)
            cases = [c for c in cases if c not in too_big]

    from tqdm import tqdm

    from ports.harness.runner import run_case

    quiet = args.json == "-" or args.csv == "-"
    if not env.has_gpu() and not quiet:
        print(CPU_NOTE + "\n")
    reports = []
    failed = False
    bar = tqdm(total=len(cases) * len(specs), disable=True if args.no_progress else None,
               unit="run", file=sys.stderr, leave=False)
    try:
        for case in cases:
            rep = run_case(case, specs, seed=args.seed, graph=args.graph, progress=bar)
            reports.append(rep)
            if not quiet:
                tqdm.write(report.case_table(rep, graph=args.graph) + "\n", file=sys.stdout)
            if rep.failed:
                failed = True
                if not args.keep_going:
                    tqdm.write("stopping after a failed case (use --keep-going to run the rest)",
                               file=sys.stderr)
                    break
    finally:
        bar.close()
    if args.plot:
        report.plot_bandwidth(reports, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json or args.csv:
        rows = report.flat_rows(reports, env.metadata())
        if args.json:
            _emit(report.to_json(rows), args.json)
        if args.csv:
            _emit(report.to_csv(rows), args.csv)
    return 1 if failed or pipeline_status else 0
