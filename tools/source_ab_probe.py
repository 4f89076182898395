"""fastrope's rows built from another rope.cu beside the package's, on equal inputs. (Needs a GPU.)

An A/B of a kernel change in one process: for each case, ``fastrope.rope`` out of place and in
place from the package's rope.cu and from ``--before`` (another version of the file, e.g.
``git show REV:ports/fastrope/rope.cu > before.cu``), built through the experiment interface
(``experiment.Variant(source=...)``) and planned alike by the device's rules, so the two
sources must share the kernels' names, template arguments and parameter layouts. The rows are
timed in interleaved rounds (CUDA-graph us, the minimum of ``--reps`` medians), beside the
same-size copy the suites' % of copy divides by, and the before rows' outputs are checked to
equal the package's bit for bit first (an A/B of a change that keeps the arithmetic).

Cases: the named suites' (default: peers and decode), with ``--step-only`` those the design
runs on the step kernel (decode steps and L2-sized prefills). In place rotates its buffers
again on every replay.

    python -m tools.source_ab_probe --before before.cu [--suites peers decode] [--step-only]
        [--reps 3] [--json FILE] [--commit SHA]
"""
from __future__ import annotations

import torch

from ports.fastrope import experiment
from ports.harness.suites import SUITES, get_suite
from ports.harness.timing import copy_us, graph_median_us, min_of_interleaved
from reference.case import make_inputs
from tools._probe_kit import (parse_probe_arguments, probe_parser, registry_arguments,
                              require_gpu, write_requested)

COLUMNS = ["case", "mode", "before us", "after us", "after / before", "same-size copy us"]


def _rows(case, inputs, variants: dict, reps: int) -> dict:
    """Each variant's call in each mode, checked to give the first variant's outputs."""
    kw = registry_arguments(case, inputs)
    calls, expected = {}, {}
    for name, variant in variants.items():
        for mode in ("out of place", "in place"):
            buffers = [x.clone() for x in inputs.xs]
            in_place = mode == "in place"
            args = buffers if in_place else inputs.xs

            def call(args=args, variant=variant, in_place=in_place):
                return experiment.apply_rope(*args, variant=variant, in_place=in_place, **kw)

            outs = call()
            outs = tuple(b.clone() for b in buffers) if in_place else (
                outs if isinstance(outs, tuple) else (outs,))
            if mode in expected:
                if not all(torch.equal(a, b) for a, b in zip(expected[mode], outs)):
                    raise AssertionError(f"{case.describe()}, {mode}: {name}'s outputs differ "
                                         "from the package's")
            else:
                expected[mode] = outs
            calls[(name, mode)] = call
    return min_of_interleaved(calls, reps=reps, timer=graph_median_us)


def _step_kernel(case, inputs) -> bool:
    kw = registry_arguments(case, inputs)
    return all(p.step for p in experiment.plans(*[x.clone() for x in inputs.xs], **kw))


def main(argv=None) -> int:
    ap = probe_parser("tools.source_ab_probe", __doc__, reps=3)
    ap.add_argument("--before", required=True, help="the other rope.cu (a file)")
    ap.add_argument("--suites", nargs="*", default=["peers", "decode"])
    ap.add_argument("--step-only", action="store_true",
                    help="only the cases the design runs on the step kernel")
    args = parse_probe_arguments(ap, argv)
    bad = [s for s in args.suites if s not in SUITES]
    if bad:
        ap.error(f"unknown suite {', '.join(bad)}; known: {', '.join(SUITES)}")
    try:
        with open(args.before, encoding="utf-8") as f:
            before = experiment.Variant(source=f.read())
    except (OSError, ValueError) as e:
        ap.error(f"--before {args.before}: {e}")
    require_gpu(ap)
    variants = {"after": experiment.DESIGN, "before": before}
    rows = []
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for suite in args.suites:
        for case in get_suite(suite):
            inputs = make_inputs(case, 0, torch.device("cuda"))
            if args.step_only and not _step_kernel(case, inputs):
                continue
            times = _rows(case, inputs, variants, args.reps)
            copy = copy_us(case.io_bytes() // 2, graph=True)
            for mode in ("out of place", "in place"):
                b, a = times[("before", mode)], times[("after", mode)]
                rows.append([case.describe(), mode, f"{b:.2f}", f"{a:.2f}", f"{a / b:.3f}",
                             f"{copy:.2f}"])
                print("| " + " | ".join(rows[-1]) + " |", flush=True)
            del inputs
            torch.cuda.empty_cache()
    write_requested(args, argv, tool="tools.source_ab_probe", doc=__doc__,
                    section="fastrope's rows from two versions of rope.cu", columns=COLUMNS,
                    rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
