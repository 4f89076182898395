"""Does fastrope time differently on the harness's inputs than on fresh tensors of the same
shape (placement, alignment, table contents)? bshd 4x4096x32x128 bf16. (Needs a GPU.)

    python -m tools.harness_inputs_probe
"""
from __future__ import annotations

import torch

from ports.fastrope import apply_rope
from ports.registry import REGISTRY
from reference.case import RopeCase, make_inputs
from tools._probe_kit import best, make


def main():
    print("## bshd 4x4096x32x128 bf16: harness inputs vs fresh (us, min of 3)")
    case = RopeCase(4, 4096, 32, 128, dtype="bf16", cos_sin_dtype="same")
    inp = make_inputs(case, 0, "cuda")
    x, cos, sin = inp.xs[0], inp.cos, inp.sin
    print("harness x", x.shape, x.stride(), x.dtype, "cos", cos.shape, cos.stride(), cos.dtype,
          cos.is_contiguous(), "ptr%256", x.data_ptr() % 256, cos.data_ptr() % 256)
    fx, fcos, fsin = make("bshd", (4, 4096, 32, 128), torch.bfloat16)
    spec = next(s for s in REGISTRY if s.name == "fastrope.rope")
    fn = spec.prepare(case, inp)
    print("registry prepare      ", f"{best(fn):.1f}")
    for name, (a, c, s) in {"harness x, harness tables": (x, cos, sin),
                            "harness x, fresh tables": (x, fcos, fsin),
                            "fresh x, harness tables": (fx, cos, sin),
                            "fresh x, fresh tables": (fx, fcos, fsin),
                            "harness x, cloned tables": (x, cos.clone(), sin.clone())}.items():
        t = best(lambda: apply_rope(a, cos=c, sin=s, check_positions=False))
        print(f"{name:22s}", f"{t:.1f}",
              "equal tables" if torch.equal(c, fcos) else "tables differ")
    print("computed (harness x)  ", f"{best(lambda: apply_rope(x, inv_freq=inp.inv_freq)):.1f}")


if __name__ == "__main__":
    main()
