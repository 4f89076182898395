"""Does torch.compile's kernel structure explain its lead over fastrope with given tables?
(Needs a GPU.)

A standalone bf16 kernel in inductor's shape (``_probe_kit.FLAT_SOURCE``: a flat grid, one
16-byte chunk per thread with its partner and its cos/sin loaded by the thread, no loop),
optionally with two chunks per thread and streaming hints, checked against ``apply_rope`` and
timed against torch.compile, fastrope (given tables and computed angles) and a copy, on four bshd
shapes.

    python -m tools.inductor_shape_probe
"""
import cupy as cp
import torch

from ports.eager.canonical import _compiled_apply
from ports.fastrope import apply_rope
from tools._probe_kit import FLAT_SOURCE, make, min_of_interleaved

NAMES = [f"flat_rope<__nv_bfloat16, false, {s}, {p}>" for s in ("true", "false") for p in (1, 2)]


def main():
    mod = cp.RawModule(code=FLAT_SOURCE, options=("-std=c++17",), name_expressions=NAMES)
    comp = _compiled_apply()
    for layout, shape in (("bshd", (4, 4096, 32, 128)), ("bshd", (8, 4096, 64, 128)),
                          ("bshd", (1, 4096, 32, 128)), ("bshd", (1, 32768, 8, 128))):
        b, s, h, d = shape
        x, cos, sin = make(layout, shape, torch.bfloat16)
        ref = apply_rope(x, cos=cos, sin=sin)
        out = torch.empty_like(x)
        n = x.numel() // 8
        calls = {"compile": lambda: comp(x, None, cos[None], sin[None], 2),
                 "fastrope tab": lambda: apply_rope(x, cos=cos, sin=sin, check_positions=False),
                 "fastrope comp": lambda: apply_rope(x),
                 "copy": lambda: out.copy_(x)}
        for name in NAMES:
            fn = mod.get_function(name)
            per = int(name.split(",")[-1].strip(" >"))
            for threads in (128, 256):
                grid = -(-n // (threads * per))
                def call(fn=fn, grid=grid, threads=threads):
                    fn((grid,), (threads,), (x.data_ptr(), out.data_ptr(), cos.data_ptr(),
                                             sin.data_ptr(), cp.int64(n), cp.int32(s), cp.int32(b),
                                             cp.int32(h), cp.int32(d), cp.int32(0)))
                out.fill_(float("nan"))
                call()
                err = (out.float() - ref.float()).abs().max().item()
                calls[f"{name} t{threads}{'' if err < 0.05 else ' BAD'}"] = call
        res = min_of_interleaved(calls)
        print(shape, " | ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
