"""Second probe: sbhd fold x angle source, decode launch shapes, and an ncu target."""
from __future__ import annotations

import pathlib
import sys

import torch

from ports.eager.canonical import _compiled_apply
from ports.fastrope import api
from tools.study_probe import best, decode_inputs
from tools.study_sweep import checked_launch, make, min_of_interleaved


def sbhd_fold():
    print("## sbhd fold x angle source (min of 3 medians, us; interleaved reps)")
    for shape in ((4, 4096, 32, 128), (8, 4096, 64, 128)):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            x, cos, sin = make("sbhd", shape, dtype)
            comp = _compiled_apply()
            rows, srows = cos[:, None, :], sin[:, None, :]
            fns = {"compile": lambda: comp(x, None, rows, srows, 2)}
            for order in (False, True):
                t = api.Tuning(memory_order=order)
                fns[f"tab fold={int(order)}"] = (lambda t=t: api.apply_rope(
                    x, cos=cos, sin=sin, layout="sbhd", check_positions=False, _tuning=t))
                fns[f"comp fold={int(order)}"] = (lambda t=t: api.apply_rope(
                    x, layout="sbhd", _tuning=t))
            res = min_of_interleaved(fns)
            print(f"{shape} {str(dtype)[6:]:8s}", " | ".join(f"{k} {t:.1f}" for k, t in res.items()))


def decode_shapes():
    print("## decode b=64 h=32 d=128 bf16 tables, offsets: launch shapes (graph us, min of 3)")
    x, cos, sin, *_ = decode_inputs()
    out = torch.empty_like(x)
    src = pathlib.Path("ports/fastrope/rope.cu").read_text()
    ref = api.apply_rope(x, cos=cos, sin=sin)
    for unroll in (1, 2):
        for splits in (None, 1, 2, 4, 8, 16, 32):
            call, p, ok = checked_launch(x, out, cos, sin, ref, "bshd", False, unroll, 1, splits,
                                         src)
            print(f"unroll={unroll} splits={splits} grid={p.grid} block={p.block} "
                  f"{'ok' if ok else 'BAD'} graph {best(call, graph=True):.2f}")


def ncu_prefill(layout="bshd", shape=(4, 4096, 32, 128), dtype=torch.bfloat16):
    """One prefill launch each of tables, computed angles, torch.compile and a copy, for ncu."""
    x, cos, sin = make(layout, shape, dtype)
    rows = cos[None, :, :] if layout == "bshd" else cos[:, None, :]
    srows = sin[None, :, :] if layout == "bshd" else sin[:, None, :]
    comp = _compiled_apply()
    same = torch.empty_like(x)
    calls = [lambda: api.apply_rope(x, cos=cos, sin=sin, layout=layout, check_positions=False),
             lambda: api.apply_rope(x, layout=layout),
             lambda: comp(x, None, rows, srows, 2),
             lambda: same.copy_(x)]
    for _ in range(3):
        for f in calls:
            f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for f in calls:
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def ncu_target():
    """One decode launch of each, for ncu (after warm-up)."""
    x, cos, sin, offs, rows, srows = decode_inputs()
    comp = _compiled_apply()
    for _ in range(3):
        comp(x, None, rows, srows, 2)
        api.apply_rope(x, cos=cos, sin=sin, offsets=offs, check_positions=False)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    comp(x, None, rows, srows, 2)
    api.apply_rope(x, cos=cos, sin=sin, offsets=offs, check_positions=False)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    if "--ncu-prefill" in sys.argv:
        ncu_prefill()
    elif "--ncu" in sys.argv:
        ncu_target()
    else:
        sbhd_fold()
        decode_shapes()
