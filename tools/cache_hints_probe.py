"""Streaming (evict-first) hints by size, at every size, or never: fastrope in place and out of
place on a suite's forward rotate-half cases, beside the peers' rows, in CUDA graphs. (Needs a
GPU.)

The design (plan.py) drops the hints where the bytes a call reads and writes fit in the L2;
``hints_at_every_size`` keeps them everywhere; ``NO_CACHE_HINTS`` drops them everywhere. Each row
is prepared by the registry on the case's own inputs (the rows the suites time), and the minimum
of ``--reps`` interleaved medians is printed, in us.

    python -m tools.cache_hints_probe [--suite prefill peers] [--max-mib 64] [--reps 3]
"""
from __future__ import annotations

import argparse

import torch

from ports import registry
from ports.fastrope import kernel
from ports.fastrope.ablation import Tuning
from ports.fastrope.canonical import _preparer
from ports.harness.suites import get_suite
from ports.harness.timing import graph_median_us
from reference.case import make_inputs
from tools._probe_kit import min_of_interleaved

FASTROPE = {  # column: (tuning, in place)
    "by size": (None, False),
    "always": (Tuning(hints_at_every_size=True), False),
    "never": (Tuning(flags=kernel.NO_CACHE_HINTS), False),
    "in place by size": (None, True),
    "in place always": (Tuning(hints_at_every_size=True), True),
    "in place never": (Tuning(flags=kernel.NO_CACHE_HINTS), True),
}
PEERS = {"flash-attn": "flash_attn.apply_rotary", "flash-attn in place":
         "flash_attn.apply_rotary_inplace", "liger (in place)": "liger.rope",
         "torch.compile": "torch.compile(hf_rotate_half)"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", nargs="+", default=["prefill", "peers"])
    ap.add_argument("--max-mib", type=float, default=None,
                    help="only cases whose tensors (q and k) take at most this many MiB")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    for suite in args.suite:
        for case in get_suite(suite):
            if case.style != "rotate_half" or case.direction != "forward":
                continue
            inputs = make_inputs(case, 0, torch.device("cuda"))
            mib = sum(x.numel() * x.element_size() for x in inputs.xs) / 2**20
            if args.max_mib is not None and mib > args.max_mib:
                continue
            calls = {name: _preparer(in_place=in_place, tuning=tuning)(case, inputs)
                     for name, (tuning, in_place) in FASTROPE.items()}
            for name, impl in PEERS.items():
                spec = registry.get(impl)
                missing = getattr(spec, "missing", None)  # peers: None when installed
                if spec.unsupported_reason(case) is None and not (missing and missing()):
                    calls[name] = spec.prepare(case, inputs)
            times = min_of_interleaved(calls, reps=args.reps, timer=graph_median_us)
            print(f"{suite}: {case.describe()} ({mib:.0f} MiB)")
            print("   " + "  ".join(f"{name} {us:.2f}" for name, us in times.items()), flush=True)
            del inputs, calls
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
