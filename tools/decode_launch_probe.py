"""What does fastrope's decode step (b=64, s=1, h=32, d=128, bf16) cost for each position form
and each launch shape, against torch.compile? (Needs a GPU.)

``positions``: the public call with an offsets tensor, an int offset, ids and computed angles,
CUDA-graph and event timed. ``shapes``: direct launches with 1-2 heads per thread and 1-32 head
splits, each checked against ``apply_rope`` and timed in CUDA graphs.

    python -m tools.decode_launch_probe [positions] [shapes]     (default: both)
"""
from __future__ import annotations

import pathlib
import sys

import torch

from ports.eager.canonical import _compiled_apply
from ports.fastrope import apply_rope
from tools._probe_kit import best, checked_launch, decode_inputs, run_named


def positions():
    print("## decode b=64 h=32 d=128 bf16, graph us (min of 3)")
    x, cos, sin, offs, rows, srows = decode_inputs()
    comp = _compiled_apply()
    kw = dict(check_positions=False)
    cases = {
        "compile (rows gathered outside)": lambda: comp(x, None, rows, srows, 2),
        "offsets tensor": lambda: apply_rope(x, cos=cos, sin=sin, offsets=offs, **kw),
        "int offset (no position load)": lambda: apply_rope(x, cos=cos, sin=sin, offsets=7, **kw),
        "computed, offsets tensor": lambda: apply_rope(x, offsets=offs, **kw),
        "computed, int offset": lambda: apply_rope(x, offsets=7, **kw),
        "ids [b,1]": lambda: apply_rope(x, cos=cos, sin=sin, positions=offs[:, None], **kw),
        "copy 512 KB": lambda: torch.empty_like(x).copy_(x),
    }
    for name, fn in cases.items():
        print(f"{name:40s} graph {best(fn, graph=True):6.2f}  event {best(fn):6.2f}")


def shapes():
    print("## decode b=64 h=32 d=128 bf16 tables, offsets: launch shapes (graph us, min of 3)")
    x, cos, sin, *_ = decode_inputs()
    out = torch.empty_like(x)
    src = pathlib.Path("ports/fastrope/rope.cu").read_text()
    ref = apply_rope(x, cos=cos, sin=sin)
    for unroll in (1, 2):
        for splits in (None, 1, 2, 4, 8, 16, 32):
            call, p, ok = checked_launch(x, out, cos, sin, ref, "bshd", False, unroll, 1, splits,
                                         src)
            print(f"unroll={unroll} splits={splits} grid={p.grid} block={p.block} "
                  f"{'ok' if ok else 'BAD'} graph {best(call, graph=True):.2f}")


PROBES = {"positions": positions, "shapes": shapes}

if __name__ == "__main__":
    run_named(PROBES, sys.argv[1:])
