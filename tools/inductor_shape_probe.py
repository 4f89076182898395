"""Does torch.compile's kernel structure explain its lead over fastrope with given tables?
(Needs a GPU.)

A standalone bf16 kernel in inductor's shape (a flat grid, one 16-byte chunk per thread with its
partner and its cos/sin loaded by the thread, no loop), optionally with two chunks per thread and
streaming hints, checked against ``apply_rope`` and timed against torch.compile, fastrope (given
tables and computed angles) and a copy, on four bshd shapes.

    python -m tools.inductor_shape_probe
"""
import cupy as cp
import torch

from ports.eager.canonical import _compiled_apply
from ports.fastrope import apply_rope
from tools._probe_kit import make, min_of_interleaved

SRC = r'''
#include <cuda_bf16.h>
template <bool STREAM, int PER>
__global__ void flat_rope(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ out,
                          const __nv_bfloat16* __restrict__ cos, const __nv_bfloat16* __restrict__ sin,
                          int n_chunks, int S, int H, int D) {
  #pragma unroll
  for (int k = 0; k < PER; ++k) {
  const int t = (blockIdx.x * PER + k) * blockDim.x + threadIdx.x;
  if (t >= n_chunks) return;
  const int e = t * 8;
  const int d = e % D, row = e / D;
  const int s = (row / H) % S;
  const int half = D / 2;
  const int pe = d < half ? e + half : e - half;
  uint4 xv, pv;
  if (STREAM) { xv = __ldcs((const uint4*)(x + e)); pv = __ldcs((const uint4*)(x + pe)); }
  else { xv = *(const uint4*)(x + e); pv = *(const uint4*)(x + pe); }
  const uint4 cv = *(const uint4*)(cos + (long)s * D + d), sv = *(const uint4*)(sin + (long)s * D + d);
  const __nv_bfloat16 *xe = (const __nv_bfloat16*)&xv, *pe_ = (const __nv_bfloat16*)&pv,
                      *ce = (const __nv_bfloat16*)&cv, *se = (const __nv_bfloat16*)&sv;
  uint4 o; __nv_bfloat16* oe = (__nv_bfloat16*)&o;
  const float sign = d < half ? -1.f : 1.f;
  #pragma unroll
  for (int i = 0; i < 8; ++i)
    oe[i] = __float2bfloat16_rn(fmaf(__bfloat162float(xe[i]), __bfloat162float(ce[i]),
                                     sign * __bfloat162float(pe_[i]) * __bfloat162float(se[i])));
  if (STREAM) __stcs((uint4*)(out + e), o); else *(uint4*)(out + e) = o;
  }
}
'''
NAMES = [f"flat_rope<{s}, {p}>" for s in ("true", "false") for p in (1, 2)]


def main():
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=NAMES)
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
            per = int(name.split(",")[1].strip(" >"))
            for threads in (128, 256):
                grid = -(-n // (threads * per))
                def call(fn=fn, grid=grid, threads=threads):
                    fn((grid,), (threads,), (x.data_ptr(), out.data_ptr(), cos.data_ptr(),
                                             sin.data_ptr(), cp.int32(n), cp.int32(s), cp.int32(h),
                                             cp.int32(d)))
                out.fill_(float("nan"))
                call()
                err = (out.float() - ref.float()).abs().max().item()
                calls[f"{name} t{threads}{'' if err < 0.05 else ' BAD'}"] = call
        res = min_of_interleaved(calls)
        print(shape, " | ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
