"""Where does fastrope's decode step (b=64, s=1, h=32, d=128, bf16, one offset per sequence)
spend its time in CUDA graphs: launch, reading the argument, the dependent row load, or its own
set-up? (Needs a GPU.)

It times, in CUDA graphs, against minimal kernels:

* empty kernels with an 8-byte and a 264-byte (the size of rope.cu's Params) argument: launch
  cost; kernels reading one or five 64-byte lines of the argument, at once or one after another;
* a minimal rotate-half kernel, one 16-byte chunk per thread, reading cos/sin rows gathered
  beforehand (torch.compile's inputs: x and the row load in parallel) or through the offset
  (offset -> row, a dependent load, as fastrope must);
* fastrope (offsets tensor, int offset, and narrower accesses or one head per step through the
  ablation module) and torch.compile.

    python -m tools.decode_cost_breakdown
"""
from __future__ import annotations

import cupy as cp
import torch

from ports import _cupy
from ports.eager.canonical import _compiled_apply
from ports.fastrope import ablation, apply_rope
from tools._probe_kit import best, decode_inputs

SRC = r'''
#include <cuda_bf16.h>
struct Big { unsigned long long w[33]; };
extern "C" __global__ void empty_small(unsigned long long) {}
extern "C" __global__ void empty_big(Big) {}
// Reading the argument: one 64-byte line, five lines at once, five lines one after another.
extern "C" __global__ void read_one_line(Big p, unsigned long long* out) {
  if (p.w[blockIdx.x & 1] == 12345) out[0] = 1;
}
extern "C" __global__ void read_five_lines(Big p, unsigned long long* out) {
  const unsigned long long v = p.w[0] + p.w[8] + p.w[16] + p.w[24] + p.w[32];
  if (v == 12345 + blockIdx.x) out[0] = v;
}
extern "C" __global__ void read_five_lines_chained(Big p, unsigned long long* out) {
  unsigned long long v = p.w[0];
  if (v == 0) v = p.w[8] + 1;
  if (v == 1) v = p.w[16] + 2;
  if (v == 2) v = p.w[24] + 3;
  if (v == 3) v = p.w[32] + 4;
  if (v == 12345 + blockIdx.x) out[0] = v;
}

// x [B, 1, H, D] bf16; row r of cos/sin: rows[b] (gathered) or table[offs[b]] (through offsets).
template <bool GATHERED>
__global__ void minimal(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ out,
                        const __nv_bfloat16* __restrict__ cos, const __nv_bfloat16* __restrict__ sin,
                        const long long* __restrict__ offs, int n_chunks, int H, int D) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n_chunks) return;
  const int e = t * 8, d = e % D, b = e / (D * H), half = D / 2;
  const long long row = GATHERED ? b : offs[b];
  const int pe = d < half ? e + half : e - half;
  const uint4 xv = *(const uint4*)(x + e), pv = *(const uint4*)(x + pe);
  const uint4 cv = *(const uint4*)(cos + row * D + d), sv = *(const uint4*)(sin + row * D + d);
  const __nv_bfloat16 *xe = (const __nv_bfloat16*)&xv, *p = (const __nv_bfloat16*)&pv,
                      *c = (const __nv_bfloat16*)&cv, *s = (const __nv_bfloat16*)&sv;
  uint4 o; __nv_bfloat16* oe = (__nv_bfloat16*)&o;
  const float sign = d < half ? -1.f : 1.f;
#pragma unroll
  for (int i = 0; i < 8; ++i)
    oe[i] = __float2bfloat16_rn(fmaf(__bfloat162float(xe[i]), __bfloat162float(c[i]),
                                     sign * __bfloat162float(p[i]) * __bfloat162float(s[i])));
  *(uint4*)(out + e) = o;
}
'''


def _on_torch_stream(fn, grid, block, args):
    """Launch on torch's current stream (the capturing one inside a CUDA graph)."""
    def call():
        dev = torch.cuda.current_device()
        fn(grid, block, args, stream=_cupy._external_stream(_cupy._current_raw_stream(dev), dev))
    return call


def main():
    mod = cp.RawModule(code=SRC, options=("-std=c++17",),
                       name_expressions=["minimal<true>", "minimal<false>"])
    small, big = mod.get_function("empty_small"), mod.get_function("empty_big")
    import numpy as np
    big_arg = np.zeros(1, dtype=[("w", np.uint64, (33,))])[0]  # a 264-byte struct by value
    sink = torch.zeros(1, dtype=torch.int64, device="cuda")
    x, cos, sin, offs, rows, srows = decode_inputs()
    out = torch.empty_like(x)
    n = x.numel() // 8
    ref = apply_rope(x, cos=cos, sin=sin, offsets=offs)
    comp = _compiled_apply()
    flat_rows = rows.reshape(rows.shape[0], -1).contiguous()
    flat_srows = srows.reshape(srows.shape[0], -1).contiguous()

    def minimal(gathered, threads):
        fn = mod.get_function(f"minimal<{'true' if gathered else 'false'}>")
        c, s = (flat_rows, flat_srows) if gathered else (cos, sin)
        return _on_torch_stream(fn, ((n + threads - 1) // threads,), (threads,), (
            x.data_ptr(), out.data_ptr(), c.data_ptr(), s.data_ptr(), offs.data_ptr(),
            cp.int32(n), cp.int32(32), cp.int32(128)))

    calls = {
        "empty kernel, 8 B argument": _on_torch_stream(small, (1,), (32,), (cp.uint64(0),)),
        "empty kernel, 264 B argument": _on_torch_stream(big, (1,), (32,), (big_arg,)),
        **{f"{k}, 320 x 112 threads": _on_torch_stream(
            mod.get_function(k), (320,), (112,), (big_arg, sink.data_ptr()))
           for k in ("read_one_line", "read_five_lines", "read_five_lines_chained")},
        "minimal, rows gathered, 128 thr": minimal(True, 128),
        "minimal, rows gathered, 256 thr": minimal(True, 256),
        "minimal, through offsets, 128 thr": minimal(False, 128),
        "minimal, through offsets, 256 thr": minimal(False, 256),
        "fastrope.apply_rope, offsets": lambda: apply_rope(x, cos=cos, sin=sin, offsets=offs,
                                                         check_positions=False),
        "fastrope.apply_rope, int offset": lambda: apply_rope(x, cos=cos, sin=sin, offsets=7,
                                                            check_positions=False),
        "torch.compile (rows gathered)": lambda: comp(x, None, rows, srows, 2),
    }
    for cap in (4, 2):
        for unroll in (None, 1):
            t = ablation.Tuning(vector_cap=cap, unroll=unroll)
            calls[f"fastrope.apply_rope, offsets, V<={cap} unroll {unroll}"] = (
                lambda t=t: ablation.apply_rope(x, cos=cos, sin=sin, offsets=offs,
                                                check_positions=False, tuning=t))
    for name in ("minimal, rows gathered, 256 thr", "minimal, through offsets, 256 thr"):
        out.fill_(float("nan"))
        calls[name]()
        err = (out.float() - ref.float()).abs().max().item()
        print(f"{name}: max |err| vs fastrope {err:.3g}")
    for name, fn in calls.items():
        try:
            print(f"{name:36s} graph {best(fn, graph=True):6.2f} us")
        except Exception as exc:  # noqa: BLE001
            print(f"{name:36s} failed: {exc}")


if __name__ == "__main__":
    main()
