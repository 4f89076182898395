"""Second probe: sbhd fold x angle source, decode launch shapes, and an ncu target."""
from __future__ import annotations

import sys

import torch

from ports.eager.canonical import _compiled_apply
from ports.study import _launch, api
from tools.study_probe import best
from tools.study_sweep import launch_of, make


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
            res = {k: [] for k in fns}
            for _ in range(3):
                for k, f in fns.items():
                    res[k].append(__import__("ports.harness.timing", fromlist=["x"]).median_us(f))
            print(f"{shape} {str(dtype)[6:]:8s}", " | ".join(f"{k} {min(v):.1f}" for k, v in res.items()))
            del x


def decode_shapes():
    print("## decode b=64 h=32 d=128 bf16 tables, offsets: launch shapes (graph us, min of 3)")
    b = 64
    x = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    _, cos, sin = make("bshd", (1, 4096, 1, 128), torch.bfloat16)
    out = torch.empty_like(x)
    src = open("ports/study/rope.cu").read()
    ref = api.apply_rope(x, cos=cos, sin=sin)
    for unroll in (1, 2):
        for splits in (None, 1, 2, 4, 8, 16, 32):
            lc, p = launch_of(x, out, cos, sin, "bshd", False, unroll, 1, splits, src)
            a = (x.data_ptr(), 0, out.data_ptr(), 0, cos.data_ptr(), sin.data_ptr(), 0, 0, 0, 0)
            out.fill_(float("nan"))
            _launch.launch(lc, *a)
            ok = torch.equal(out, ref)
            print(f"unroll={unroll} splits={splits} grid={p.grid} block={p.block} "
                  f"{'ok' if ok else 'BAD'} graph {best(lambda: _launch.launch(lc, *a), graph=True):.2f}")


def ncu_target():
    """One decode launch of each, for ncu (after warm-up)."""
    b = 64
    x = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    _, cos, sin = make("bshd", (1, 4096, 1, 128), torch.bfloat16)
    offs = torch.randint(0, 4095, (b,), device="cuda")
    rows, srows = cos[offs][:, None, :], sin[offs][:, None, :]
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
    if "--ncu" in sys.argv:
        ncu_target()
    else:
        sbhd_fold()
        decode_shapes()
