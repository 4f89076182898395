"""What the fastrope probes under tools/ share (GPU only): inputs, direct launches of rope.cu with
a chosen plan and register cap, and timers.

Not a tool itself; the tools import it (run them from the repository root with ``python -m``).
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from ports import _cupy
from ports.fastrope import kernel, launcher, plan, problem
from ports.harness.timing import graph_median_us, median_us

__all__ = ["FLAT_SOURCE", "best", "checked_launch", "decode_inputs", "launch_of", "make",
           "min_of_interleaved", "run_named", "stream_graph_us", "traffic_only", "with_hints"]

# torch.compile's kernel shape written in CUDA: a flat grid over the 16-byte chunks of x (bshd or
# sbhd, rotate-half, 16-bit) in memory order, each thread loading its chunk, its partner in the
# other half and its full-width cos/sin chunk (in x's dtype), no loop; PER chunks per thread (the
# grid covers n_chunks / PER threads); BWD rotates by -theta (symmetric tables). Out of place only:
# in place, a partner could be read after its owner stored it.
FLAT_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
template <typename T, bool BWD, bool STREAM, int PER>
__global__ void flat_rope(const T* __restrict__ x, T* __restrict__ out, const T* __restrict__ cos,
                          const T* __restrict__ sin, long long n_chunks, int S, int B, int H,
                          int D, int sbhd) {
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const long long t = ((long long)blockIdx.x * PER + k) * blockDim.x + threadIdx.x;
    if (t >= n_chunks) return;
    const long long e = t * 8, token = e / D / H;
    const int d = (int)(e % D), half = D / 2;
    const long long s = sbhd ? token / B : token % S;
    const long long pe = d < half ? e + half : e - half;
    uint4 xv, pv;
    if (STREAM) { xv = __ldcs((const uint4*)(x + e)); pv = __ldcs((const uint4*)(x + pe)); }
    else { xv = *(const uint4*)(x + e); pv = *(const uint4*)(x + pe); }
    const uint4 cv = *(const uint4*)(cos + s * D + d), sv = *(const uint4*)(sin + s * D + d);
    const T *xe = (const T*)&xv, *xp = (const T*)&pv, *ce = (const T*)&cv, *se = (const T*)&sv;
    uint4 o;
    T* oe = (T*)&o;
    const float sign = (d < half) != BWD ? -1.f : 1.f;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      oe[i] = T(fmaf(float(xe[i]), float(ce[i]), sign * float(xp[i]) * float(se[i])));
    if (STREAM) __stcs((uint4*)(out + e), o); else *(uint4*)(out + e) = o;
  }
}
"""

# rope.cu's streaming (evict-first) word accesses, and the plain ones a variant puts in their place
STREAMING = {"loads": ("if constexpr (STREAM) return __ldcs(p); else return *p;", "return *p;"),
             "stores": ("if constexpr (STREAM) __stcs(p, v); else *p = v;", "*p = v;")}


def make(layout, shape, dtype):
    """x in ``layout`` for ``shape`` (b, s, h, d) and full-width rotate-half tables in x's dtype
    (angles from base 10000 in fp64)."""
    b, s, h, d = shape
    x = torch.randn((s, b, h, d) if layout == "sbhd" else (b, s, h, d), device="cuda", dtype=dtype)
    ang = torch.arange(s, device="cuda", dtype=torch.float64)[:, None] * (
        10000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float64) / d))
    ang = torch.cat([ang, ang], -1)
    return x, ang.cos().to(dtype), ang.sin().to(dtype)


def decode_inputs(b=64):
    """A decode step: x [b, 1, 32, 128] bf16, 4k-row tables, one offset per sequence, and the
    rows torch.compile's call gets gathered beforehand."""
    x = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    _, cos, sin = make("bshd", (1, 4096, 1, 128), torch.bfloat16)
    offs = torch.randint(0, 4095, (b,), device="cuda")
    return x, cos, sin, offs, cos[offs][:, None, :], sin[offs][:, None, :]


def launch_of(x, out, cos, sin, layout, computed, unroll, min_blocks, splits, source,
              memory_order=True):
    """The launch of rope.cu's ``source`` text for x (sbhd or bshd, full rotary, rotate-half),
    with ``unroll`` heads per step (None: the plan's), ``splits`` head splits (None: the plan's)
    and ``__launch_bounds__`` minimum blocks ``min_blocks`` (rope.cu's STUDY_MIN_BLOCKS_CAP)."""
    b, s = (x.shape[1], x.shape[0]) if layout == "sbhd" else (x.shape[0], x.shape[1])
    h, d = x.shape[2], x.shape[3]
    op = plan.Operand(x, out, h, problem.strides(x, layout), problem.strides(out, layout))
    p = plan.choose(operands=[op], batch=b, seqlen=s, head_dim=d, rotary_dim=d,
                    interleaved=False, tables=None if computed else (cos, sin, False),
                    computed=computed, in_place=False, unroll=unroll, memory_order=memory_order)
    if splits:
        hps = -(-h // splits)
        lanes = min(p.block[1], hps)
        tpb = max(1, min(plan.MAX_TOKENS_PER_BLOCK,
                         plan.THREADS_PER_BLOCK // (p.block[0] * lanes), s))
        if computed:
            tpb = min(tpb, p.block[2])
        p = dataclasses.replace(p, grid=(-(-s // tpb), b, -(-h // hps)),
                                block=(p.block[0], lanes, tpb), heads_per_split=hps,
                                shared_mem=p.shared_mem // p.block[2] * tpb)
    lc = launcher.prepare(p, [op], seqlen=s, half=d // 2, half_table=False,
                          table_rows=cos.shape[0], table_stride=cos.stride(0), pos_mode=0,
                          pos_strides=(0, 0), pos_int32=False, nseq=0, backward=False)
    opts = (f"-DSTUDY_MIN_BLOCKS_CAP={min_blocks}",)
    fn = _cupy._load(x.get_device(), source, kernel.FILENAME, opts, (p.kernel,))[p.kernel]
    lc = dataclasses.replace(lc, function=fn.ptr)
    return lc, p


def checked_launch(x, out, cos, sin, ref, layout, computed, unroll, min_blocks, splits, source,
                   memory_order=True):
    """One configuration, launched once on a NaN-poisoned ``out`` and checked against ``ref``
    (bit for bit with tables; computed angles differ from the tables' rounding). Returns the
    zero-argument launch, its plan and whether it matched."""
    lc, p = launch_of(x, out, cos, sin, layout, computed, unroll, min_blocks, splits, source,
                      memory_order)
    inv = problem.default_inv_freq(x.device, x.shape[-1], 10000.0) if computed else None
    args = (x.data_ptr(), 0, out.data_ptr(), 0, cos.data_ptr(), sin.data_ptr(),
            0 if inv is None else inv.data_ptr(), 0, 0, 0)
    out.fill_(float("nan"))
    launcher.launch(lc, *args)
    ok = torch.equal(out, ref) if not computed else (out - ref).abs().max().item() < 0.1
    return (lambda inv=inv: launcher.launch(lc, *args)), p, ok  # the call keeps inv alive


def best(fn, reps=3, graph=False):
    """The minimum of ``reps`` medians (CUDA-graph replays with ``graph``, else events), us."""
    t = graph_median_us if graph else median_us
    return min(t(fn) for _ in range(reps))


def stream_graph_us(fn, stream, calls: int, replays: int = 10) -> float:
    """us per call of a CUDA graph of ``calls`` calls of ``fn`` captured on ``stream`` (an autograd
    backward must be captured on the stream its forward ran on), the median of ``replays``
    replays."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        g.replay()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def min_of_interleaved(calls, reps=3, timer=median_us):
    """The minimum over ``reps`` rounds of each call's median, rounds interleaved across calls."""
    times = {k: [] for k in calls}
    for _ in range(reps):
        for k, f in calls.items():
            times[k].append(timer(f))
    return {k: min(v) for k, v in times.items()}


def with_hints(source: str, hints: str) -> str:
    """rope.cu's ``source`` with its data ``"loads/stores"`` past the L2 streaming (``cs``, the
    design) or plain (``plain``): ``"cs/plain"`` keeps streaming loads and plain stores."""
    for access, kind in zip(("loads", "stores"), hints.split("/"), strict=True):
        streaming, plain = STREAMING[access]
        if streaming not in source:
            raise ValueError(f"rope.cu's streaming {access} changed: update STREAMING")
        if kind not in ("cs", "plain"):
            raise ValueError(f"hints are cs or plain for loads and for stores, got {hints!r}")
        source = source.replace(streaming, plain) if kind == "plain" else source
    return source


# rope.cu's rotations of a chunk (rotate_store), and what traffic_only puts in their place: no
# math, the chunk stored as loaded, every element of the table chunk still loaded (their sum
# never reaches -1e30, as |cos|, |sin| <= 1, but keeps every load live)
NO_ROTATION = ("{{ float t = 0.f; for (int i = 0; i < {n}; ++i) t += {terms}; "
               "if (t == -1e30f) x = y; }}")
ROTATIONS = {
    "rotate_split<T, V, LO>(ang, x, y);": NO_ROTATION.format(n="V", terms="ang.cA[i] + ang.sA[i]"),
    "rotate<T, V, INTERLEAVED, LO>(ang, x, y);": NO_ROTATION.format(
        n="Angles<V, INTERLEAVED>::N", terms="ang.cA[i] + ang.sA[i] + ang.cB[i] + ang.sB[i]"),
}


def traffic_only(source: str) -> str:
    """rope.cu's ``source`` as a minimal kernel: the same launch, loads (data and table) and
    stores, without the rotation, so that it copies its input (the memory traffic alone)."""
    for rotation, replacement in ROTATIONS.items():
        if source.count(rotation) != 1:
            raise ValueError(f"rope.cu's rotation call {rotation!r} changed: update ROTATIONS")
        source = source.replace(rotation, replacement)
    return source


def run_named(probes: dict, names: list[str]) -> None:
    """Run the probes named on the command line (all of them without names), in order."""
    unknown = [n for n in names if n not in probes]
    if unknown:
        raise SystemExit(f"unknown probe {', '.join(unknown)}; choose from {', '.join(probes)}")
    for name in names or probes:
        probes[name]()
