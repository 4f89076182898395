"""Does fastrope's sbhd grid gain from walking the (s, b) tokens in memory order (b fastest)
instead of one sequence per grid row, with given tables and with computed angles? (Needs a GPU.)

``order``: direct launches of rope.cu with and without the memory-order walk, one and the plan's
heads per step, checked against ``apply_rope`` and timed beside torch.compile. ``fold``: the same
question through the public path and the ``sequence_per_block_row`` ablation, per dtype, with
interleaved repetitions.

    python -m tools.sbhd_grid_order_probe [order] [fold]     (default: both)
"""
from __future__ import annotations

import pathlib
import sys

import torch

from ports.eager.canonical import _compiled_apply
from ports.fastrope import ablation, apply_rope
from tools._probe_kit import best, checked_launch, make, min_of_interleaved, run_named


def order():
    print("## sbhd grid order, direct launches (min of 3 medians, us)")
    src = pathlib.Path("ports/fastrope/rope.cu").read_text()
    for shape, dtype in (((4, 4096, 32, 128), torch.bfloat16), ((8, 4096, 64, 128), torch.bfloat16),
                         ((4, 4096, 32, 128), torch.float32), ((1, 4096, 32, 128), torch.bfloat16)):
        x, cos, sin = make("sbhd", shape, dtype)
        out = torch.empty_like(x)
        ref = apply_rope(x, cos=cos, sin=sin, layout="sbhd")
        line = [f"{shape} {dtype}"]
        rows, srows = cos[:, None, :], sin[:, None, :]
        comp = _compiled_apply()
        line.append(f"compile {best(lambda: comp(x, None, rows, srows, 2)):.1f}")
        for memory_order in (False, True):
            for unroll in (None, 1):
                call, p, ok = checked_launch(x, out, cos, sin, ref, "sbhd", False, unroll, 1,
                                             None, src, memory_order=memory_order)
                line.append(f"order={int(memory_order)} unroll={p.unroll} "
                            f"{'ok' if ok else 'BAD'} {best(call):.1f}")
        comp_t = best(lambda: apply_rope(x, layout="sbhd"))
        line.append(f"computed {comp_t:.1f}")
        print(" | ".join(line))


def fold():
    print("## sbhd fold x angle source (min of 3 medians, us; interleaved reps)")
    for shape in ((4, 4096, 32, 128), (8, 4096, 64, 128)):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            x, cos, sin = make("sbhd", shape, dtype)
            comp = _compiled_apply()
            rows, srows = cos[:, None, :], sin[:, None, :]
            fns = {"compile": lambda: comp(x, None, rows, srows, 2)}
            for memory_order in (False, True):
                t = ablation.Tuning(memory_order=memory_order)
                fns[f"tab fold={int(memory_order)}"] = (lambda t=t: ablation.apply_rope(
                    x, cos=cos, sin=sin, layout="sbhd", check_positions=False, tuning=t))
                fns[f"comp fold={int(memory_order)}"] = (lambda t=t: ablation.apply_rope(
                    x, layout="sbhd", tuning=t))
            res = min_of_interleaved(fns)
            print(f"{shape} {str(dtype)[6:]:8s}",
                  " | ".join(f"{k} {t:.1f}" for k, t in res.items()))


PROBES = {"order": order, "fold": fold}

if __name__ == "__main__":
    run_named(PROBES, sys.argv[1:])
