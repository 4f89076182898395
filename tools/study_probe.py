"""Probes for the study kernel's remaining gaps (exploration, GPU only): sbhd grid order,
the decode step's position -> row chain, and harness inputs against fresh ones.

    PYTHONPATH=. python3 tools/study_probe.py
"""
from __future__ import annotations

import pathlib

import torch

from ports.eager.canonical import _compiled_apply
from ports.harness.timing import graph_median_us, median_us
from ports.fastrope import api
from reference.case import RopeCase, make_inputs
from tools.study_sweep import checked_launch, make


def best(fn, reps=3, graph=False):
    t = graph_median_us if graph else median_us
    return min(t(fn) for _ in range(reps))


def sbhd_order():
    print("## sbhd grid order (min of 3 medians, us)")
    src = pathlib.Path("ports/fastrope/rope.cu").read_text()
    for shape, dtype in (((4, 4096, 32, 128), torch.bfloat16), ((8, 4096, 64, 128), torch.bfloat16),
                         ((4, 4096, 32, 128), torch.float32), ((1, 4096, 32, 128), torch.bfloat16)):
        x, cos, sin = make("sbhd", shape, dtype)
        out = torch.empty_like(x)
        ref = api.apply_rope(x, cos=cos, sin=sin, layout="sbhd")
        line = [f"{shape} {dtype}"]
        rows, srows = cos[:, None, :], sin[:, None, :]
        comp = _compiled_apply()
        line.append(f"compile {best(lambda: comp(x, None, rows, srows, 2)):.1f}")
        for order in (False, True):
            for unroll in (None, 1):
                call, p, ok = checked_launch(x, out, cos, sin, ref, "sbhd", False, unroll, 1,
                                             None, src, memory_order=order)
                line.append(f"order={int(order)} unroll={p.unroll} {'ok' if ok else 'BAD'} "
                            f"{best(call):.1f}")
        comp_t = best(lambda: api.apply_rope(x, layout="sbhd"))
        line.append(f"computed {comp_t:.1f}")
        print(" | ".join(line))


def decode_inputs(b=64):
    """A decode step: x [b, 1, 32, 128] bf16, 4k-row tables, one offset per sequence, and the
    rows torch.compile's call gets gathered beforehand."""
    x = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    _, cos, sin = make("bshd", (1, 4096, 1, 128), torch.bfloat16)
    offs = torch.randint(0, 4095, (b,), device="cuda")
    return x, cos, sin, offs, cos[offs][:, None, :], sin[offs][:, None, :]


def decode():
    print("## decode b=64 h=32 d=128 bf16, graph us (min of 3)")
    x, cos, sin, offs, rows, srows = decode_inputs()
    comp = _compiled_apply()
    kw = dict(check_positions=False)
    cases = {
        "compile (rows gathered outside)": lambda: comp(x, None, rows, srows, 2),
        "study offsets tensor": lambda: api.apply_rope(x, cos=cos, sin=sin, offsets=offs, **kw),
        "study int offset (no position load)": lambda: api.apply_rope(x, cos=cos, sin=sin, offsets=7, **kw),
        "study computed, offsets tensor": lambda: api.apply_rope(x, offsets=offs, **kw),
        "study computed, int offset": lambda: api.apply_rope(x, offsets=7, **kw),
        "study ids [b,1]": lambda: api.apply_rope(x, cos=cos, sin=sin, positions=offs[:, None], **kw),
        "copy 512 KB": lambda: torch.empty_like(x).copy_(x),
    }
    for name, fn in cases.items():
        print(f"{name:40s} graph {best(fn, graph=True):6.2f}  event {best(fn):6.2f}")


def harness_vs_fresh():
    print("## bshd 4x4096x32x128 bf16: harness inputs vs fresh (us, min of 3)")
    case = RopeCase(4, 4096, 32, 128, dtype="bf16", cos_sin_dtype="same")
    inp = make_inputs(case, 0, "cuda")
    x, cos, sin = inp.xs[0], inp.cos, inp.sin
    print("harness x", x.shape, x.stride(), x.dtype, "cos", cos.shape, cos.stride(), cos.dtype,
          cos.is_contiguous(), "ptr%256", x.data_ptr() % 256, cos.data_ptr() % 256)
    fx, fcos, fsin = make("bshd", (4, 4096, 32, 128), torch.bfloat16)
    from ports.registry import REGISTRY
    spec = next(s for s in REGISTRY if s.name == "fastrope.rope")
    fn = spec.prepare(case, inp)
    print("registry prepare      ", f"{best(fn):.1f}")
    for name, (a, c, s) in {"harness x, harness tables": (x, cos, sin),
                            "harness x, fresh tables": (x, fcos, fsin),
                            "fresh x, harness tables": (fx, cos, sin),
                            "fresh x, fresh tables": (fx, fcos, fsin),
                            "harness x, cloned tables": (x, cos.clone(), sin.clone())}.items():
        print(f"{name:22s}", f"{best(lambda: api.apply_rope(a, cos=c, sin=s, check_positions=False)):.1f}",
              "equal tables" if torch.equal(c, fcos) else "tables differ")
    print("computed (harness x)  ", f"{best(lambda: api.apply_rope(x, inv_freq=inp.inv_freq)):.1f}")


if __name__ == "__main__":
    harness_vs_fresh()
    decode()
    sbhd_order()
