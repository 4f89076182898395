"""The fused QK-norm forward with full-width and half-width tables, beside copies with and without
the table rows it reads. (Needs a GPU.)

The forward must read q and k and write them; from tables it also reads each token's cos and
sin rows. For every shape and norm (per head, per token), ``qk_norm_rope`` out of place with the
suite's full-width fp32 tables ``[L, R]`` and with their first halves ``[L, R/2]`` (the same
angles; equal outputs are checked first), timed in interleaved rounds (CUDA-graph us, the
minimum of 3 medians), beside two copies timed alike: of q's and k's bytes (the suite's
``% copy``), and of those plus one read of every token's table rows (``R`` or ``R/2`` fp32
values for each of cos and sin). bf16 rows.

    python -m tools.qknorm_table_bytes_probe [--shapes NAME ...] [--json FILE] [--commit SHA]
"""
from __future__ import annotations

import argparse

import torch

from ports.fastrope.qknorm import qk_norm_rope
from ports.harness import qknorm_bench as bench
from ports.harness.timing import copy_us, graph_median_us, min_of_interleaved
from reference.tables import first_members
from tools._probe_kit import output_arguments, qknorm_shapes, write_requested

SHAPES = ["qwen3-8b prefill 4k", "qwen3-8b train 4x4k", "qwen3-8b prefill 32k"]
COLUMNS = ["shape", "norm", "tables", "forward (us)", "% copy of q and k",
           "% copy of q, k and the table rows"]


def measure(shape) -> list[list[str]]:
    calls, widths = {}, {}
    for norm in ("head", "token"):
        q, k, qw, kw, cos, sin = bench.inputs(shape, torch.bfloat16, grad=False, norm=norm)
        half = tuple(first_members(t, "rotate_half").contiguous() for t in (cos, sin))
        outs = []
        for name, (c, s) in (("[L, R]", (cos, sin)), ("[L, R/2]", half)):
            def call(q=q, k=k, qw=qw, kw=kw, c=c, s=s, norm=norm):
                return qk_norm_rope(q, k, qw, kw, bench.EPS, cos=c, sin=s, norm=norm,
                                    gemma=shape.gemma)

            outs.append(call())
            calls[norm, name] = call
            widths[name] = c.shape[1]
        if not all(torch.equal(a, b) for a, b in zip(*outs)):
            raise AssertionError(f"{shape.name}, norm={norm}: half-width tables change the "
                                 "outputs")
    us = min_of_interleaved(calls, timer=lambda f: graph_median_us(f, rep_ms=40))
    qk = (q.numel() + k.numel()) * q.element_size()
    tokens = shape.b * shape.s
    copy = copy_us(qk, graph=True)
    # copy_us(n) reads n bytes and writes n: half the table rows' bytes added reads them once
    with_rows = {name: copy_us(qk + tokens * 2 * width * 4 // 2, graph=True)
                 for name, width in widths.items()}
    return [[shape.name, norm, name, f"{t:.1f}", f"{100 * copy / t:.1f}%",
             f"{100 * with_rows[name] / t:.1f}%"] for (norm, name), t in us.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.qknorm_table_bytes_probe",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    output_arguments(ap)
    args = ap.parse_args(argv)
    rows = []
    for shape in qknorm_shapes(ap, args.shapes):
        shape_rows = measure(shape)
        rows += shape_rows
        print("\n".join(" | ".join(r) for r in shape_rows), flush=True)
    write_requested(args, argv, tool="tools.qknorm_table_bytes_probe", doc=__doc__,
                    section="the fused QK-norm's bytes: the table rows", columns=COLUMNS,
                    rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
