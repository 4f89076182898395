"""The fused QK-norm's per-head backward against its minimal kernel and a copy (needs a GPU).

The minimal kernel (``qknorm.HEAD_BWD_MINIMAL``) is the backward with its norm and rotation
replaced by a multiply-add per element: the same grid, token loop, loads (x, dy, cos, sin),
stores, weight-gradient partial rows and reduction launch. A backward that takes its minimal
kernel's time costs its memory traffic and launches, not its arithmetic. Shapes: the qknorm
suite's (bf16, Qwen3's per-head norm, the suite's inputs, fastrope's ``[L, R/2]`` tables).
Rows, CUDA-graph us of ``qknorm.backward`` (dq, dk and the weight gradients, the reduction
included), the minimum of 5 interleaved medians: the design; the minimal kernel; the
reduction alone (``qknorm.weight_grads`` on partial rows of the backward's size, a launch of
its own); a same-size copy of the bytes the backward must move (dy, q and k read, dq and dk
written); the copy, then the reduction, in one graph.

    python -m tools.qknorm_minimal_probe [--shapes NAME ...] [--json FILE --commit SHA]
"""
from __future__ import annotations

import contextlib

import torch

from ports.fastrope import qknorm
from ports.harness import qknorm_bench as bench
from ports.harness.timing import copy_of, copy_us, graph_median_us, min_of_interleaved
from tools._probe_kit import parse_probe_arguments, probe_parser, qknorm_shapes, write_requested

SHAPES = ["decode 64 tokens", "qwen3-8b prefill 4k", "qwen3-8b train 4x4k",
          "qwen3-8b prefill 32k"]
COLUMNS = ["shape", "backward (us)", "% copy", "minimal kernel (us)", "% copy",
           "reduction alone (us)", "copy, then the reduction (us)", "same-size copy (us)"]


@contextlib.contextmanager
def minimal():
    """The per-head backward built as its minimal kernel while inside."""
    saved = qknorm.HEAD_BWD_MINIMAL
    qknorm.HEAD_BWD_MINIMAL = True
    try:
        yield
    finally:
        qknorm.HEAD_BWD_MINIMAL = saved


def _partial_rows(q, k, qw, kw, kwargs):
    """Random partial rows of the per-head backward's size for this call on this GPU."""
    g = qknorm.validate(q=q, k=k, q_weight=qw, k_weight=kw, eps=bench.EPS, norm="head",
                        **{n: v for n, v in kwargs.items() if n != "gemma"})
    _, _, qb, kb, _, groups = qknorm.head_backward_grid(g, q)
    return [torch.randn(groups * n, q.shape[-1], device="cuda") for n in (qb, kb)]


def probe(shape, reps: int) -> list[str]:
    q, k, qw, kw, cos, sin = bench.inputs(shape, torch.bfloat16, grad=False)
    half_cos, half_sin = bench.fastrope_tables(cos, sin)
    gen = torch.Generator(device="cuda").manual_seed(1)
    dq_out, dk_out = (torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
                      for x in (q, k))
    kwargs = dict(cos=half_cos, sin=half_sin, positions=None, style="rotate_half",
                  layout="bshd", rotary_dim=None, base=10000.0, gemma=shape.gemma)

    def backward():
        return qknorm.backward(dq_out, dk_out, q, k, qw, kw, bench.EPS, **kwargs)

    def minimal_backward():
        with minimal():
            return backward()

    qpart, kpart = _partial_rows(q, k, qw, kw, kwargs)
    moved = 3 * (q.numel() + k.numel()) * q.element_size() // 2  # copy_of moves 2x this
    copy = copy_of(moved)

    def copy_then_reduce():
        copy()
        return qknorm.weight_grads(qpart, kpart, qw, kw)

    calls = {"backward": backward, "minimal": minimal_backward,
             "reduction": lambda: qknorm.weight_grads(qpart, kpart, qw, kw),
             "copy, reduction": copy_then_reduce}
    for f in calls.values():
        f()  # compile outside the capture
    us = min_of_interleaved(calls, reps=reps, timer=graph_median_us)
    same = copy_us(moved, graph=True)
    return [shape.name, f"{us['backward']:.1f}", f"{100 * same / us['backward']:.0f}%",
            f"{us['minimal']:.1f}", f"{100 * same / us['minimal']:.0f}%",
            f"{us['reduction']:.1f}", f"{us['copy, reduction']:.1f}", f"{same:.1f}"]


def main(argv=None) -> int:
    ap = probe_parser("tools.qknorm_minimal_probe", __doc__, reps=5)
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    args = parse_probe_arguments(ap, argv)
    shapes = qknorm_shapes(ap, args.shapes)
    rows = []
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for shape in shapes:
        rows.append(probe(shape, args.reps))
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    write_requested(args, argv, tool="tools.qknorm_minimal_probe", doc=__doc__,
                    section="the fused QK-norm's backward against its minimal kernel",
                    columns=COLUMNS, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
