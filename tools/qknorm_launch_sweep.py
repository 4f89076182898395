"""qk_norm_rope's forward launch settings swept on the qknorm suite's shapes (needs a GPU).

For each shape (bf16, Qwen3's per-head norm; the suite's inputs) every pair of the module's
``MAX_BLOCK_ELEMENTS`` (heads per program * head_dim) and ``FORWARD_WARPS`` that gives a thread
4 to 64 elements is timed out of place and in place, beside torch.compile of the unfused pair
(the suite's row, a fresh compile cache per shape) and a copy of the bytes the forward moves
(q and k read and written). CUDA-graph us, the minimum of 3 interleaved medians. Each setting's
outputs are checked against the module default's first: equal to within one bf16 rounding
(the sum of squares' order follows the block's layout). A results data file with ``--json``:

    python -m tools.qknorm_launch_sweep [--shapes NAME ...] [--json FILE] [--commit SHA]
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys

import torch

from ports.fastrope import qknorm
from ports.harness import qknorm_bench as bench
from ports.harness.env import driver_version, metadata
from ports.harness.timing import copy_us, graph_median_us
from tools._probe_kit import min_of_interleaved

BLOCK_ELEMENTS = (512, 1024, 2048, 4096, 8192)
WARPS = (1, 2, 4, 8, 16)
COLUMNS = ["shape", "block elements", "warps", "out of place (us)", "% copy", "in place (us)",
           "% copy"]


def settings():
    """The (block elements, warps) pairs timed: 4 to 64 elements a thread."""
    return [(e, w) for e, w in itertools.product(BLOCK_ELEMENTS, WARPS) if 4 <= e // (32 * w) <= 64]


def _with(block, warps, fn):
    """``fn`` run under the module's launch settings ``block``, ``warps`` (restored after)."""
    def call():
        saved = qknorm.MAX_BLOCK_ELEMENTS, qknorm.FORWARD_WARPS
        qknorm.MAX_BLOCK_ELEMENTS, qknorm.FORWARD_WARPS = block, warps
        try:
            return fn()
        finally:
            qknorm.MAX_BLOCK_ELEMENTS, qknorm.FORWARD_WARPS = saved
    return call


def sweep(shape) -> tuple[list[list[str]], float, float]:
    """(rows, copy us, compiled unfused us) of one shape."""
    q, k, qw, kw, cos, sin = bench.inputs(shape, torch.bfloat16, grad=False)
    qi, ki = q.clone(), k.clone()
    eps = bench.EPS
    ref = qknorm.qk_norm_rope(q, k, qw, kw, eps, cos=cos, sin=sin)
    calls = {}
    for block, warps in settings():
        out = _with(block, warps, lambda: qknorm.qk_norm_rope(q, k, qw, kw, eps, cos=cos,
                                                               sin=sin))()
        for o, r in zip(out, ref):  # one bf16 ulp apart at most: 2^-7 of the magnitude
            torch.testing.assert_close(o.float(), r.float(), rtol=2**-7, atol=2**-8)
        calls[block, warps, "out"] = _with(block, warps, lambda: qknorm.qk_norm_rope(
            q, k, qw, kw, eps, cos=cos, sin=sin))
        calls[block, warps, "in"] = _with(block, warps, lambda: qknorm.qk_norm_rope_inplace(
            qi, ki, qw, kw, eps, cos=cos, sin=sin))
    torch._dynamo.reset()
    compiled = torch.compile(bench.unfused, fullgraph=True)
    tables = cos[:shape.s], sin[:shape.s]
    calls["compiled"] = lambda: compiled(q, k, qw, kw, *tables, shape.gemma)
    calls["compiled"]()
    us = min_of_interleaved(calls, timer=lambda f: graph_median_us(f, rep_ms=40))
    copy = copy_us((q.numel() + k.numel()) * q.element_size(), graph=True)
    rows = [[shape.name, str(b), str(w), f"{us[b, w, 'out']:.1f}",
             f"{100 * copy / us[b, w, 'out']:.0f}%", f"{us[b, w, 'in']:.1f}",
             f"{100 * copy / us[b, w, 'in']:.0f}%"] for b, w in settings()]
    return rows, copy, us["compiled"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.qknorm_launch_sweep",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["decode 64 tokens", "qwen3-8b prefill 4k",
                                                   "qwen3-8b train 4x4k", "qwen3-8b prefill 32k"])
    ap.add_argument("--json", help="write a results data file here")
    ap.add_argument("--commit", help="the tree's commit, where the checkout's git is not it")
    args = ap.parse_args(argv)
    known = {s.name: s for s in bench.SHAPES}
    bad = [n for n in args.shapes if n not in known]
    if bad:
        ap.error(f"unknown shape {', '.join(bad)}; known: {', '.join(known)}")
    rows, notes = [], []
    for name in args.shapes:
        shape_rows, copy, compiled = sweep(known[name])
        rows += shape_rows
        notes.append(f"{name}: copy {copy:.1f} us, torch.compile of the unfused pair "
                     f"{compiled:.1f} us")
        print("\n".join(" | ".join(r) for r in shape_rows), f"\n{notes[-1]}", flush=True)
    if args.json:
        meta = metadata()
        data = {
            "document": "results/README.md", "section": "qk_norm_rope's forward launch settings",
            "context": (f"{__doc__.split(chr(10) + chr(10))[1]} The module's defaults at the "
                        f"time: {qknorm.MAX_BLOCK_ELEMENTS} elements, {qknorm.FORWARD_WARPS} "
                        f"warps. " + "; ".join(notes) + "."),
            "command": [shlex.join(["python", "-m", "tools.qknorm_launch_sweep",
                                    *(sys.argv[1:] if argv is None else argv)])],
            "commit": args.commit or meta["git_sha"], "gpu": meta["gpu"],
            "driver": driver_version(),
            "versions": {k: meta[k] for k in ("torch", "triton", "cupy")},
            "date": meta["timestamp"][:10], "columns": COLUMNS, "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
