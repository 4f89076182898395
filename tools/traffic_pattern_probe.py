"""The prefills past the L2 against plain copy kernels of several traffic patterns. (Needs a GPU.)

The minimal kernel says that fastrope's time on the large prefills is its launch's memory
traffic. This probe asks which traffic pattern moves those bytes fastest on the GPU it runs on:
copy kernels of q and k (one launch, q's blocks then k's), each block 256 threads, every thread
issuing all its loads before its stores: one 16-byte access per thread (a block moves 4 KB), two
or four (8 or 16 KB a block, the accesses of a thread 4 KB apart), 8 bytes of each half of one
128-element row (rotate-half's pair at 8-byte width; 4 KB a block), and one 8-byte access (2
KB). Beside them, on the same tensors: fastrope out of place and in place, its minimal kernel
(rope.cu built ``ROPE_TRAFFIC_ONLY``, the design's plan), flash-attn out of place and in place,
and torch's copy of the same bytes (the suites' same-size copy). Cases: the peers suite's bf16
rotate-half prefills past the L2 with a GQA k of 8 heads (8x4096x64, 1x32768x32), and the prefill
suite's q-only 8x4096x64 bf16. Last, the rotation itself in the pair pattern (a kernel of this
probe, not the package's: bf16 rotate-half, 128-element rows, half-width bf16 tables, positions
0..S-1, fastrope's fp32 math), out of place and in place. CUDA-graph us, the minimum of
interleaved medians; every copy kernel's output is checked to equal its input, and the
rotation's to equal fastrope's bit for bit (a cell reads "differs" where it does not).

    python -m tools.traffic_pattern_probe [--reps 3] [--json FILE --commit SHA]
"""
from __future__ import annotations

import warnings

import torch

from ports import registry
from ports.fastrope import experiment
from ports.harness.suites import get_suite
from ports.harness.timing import copy_us, graph_median_us, min_of_interleaved
from reference.case import make_inputs
from tools._probe_kit import (parse_probe_arguments, probe_parser, registry_arguments,
                              require_gpu, write_requested)

SOURCE = r"""
// Blocks [0, q_blocks) copy q, the rest k; n: the tensor's accesses (A) or rows (pairs).
template <typename A, int P>
__device__ void copy_blocks(const A* q, A* qo, long long nq, const A* k, A* ko, long long nk,
                            long long q_blocks) {
  long long blk = blockIdx.x;
  const A* s = q; A* d = qo; long long n = nq;
  if (blk >= q_blocks) { blk -= q_blocks; s = k; d = ko; n = nk; }
  const long long base = blk * 256 * P + threadIdx.x;
  A v[P];
#pragma unroll
  for (int j = 0; j < P; ++j) if (base + j * 256 < n) v[j] = s[base + j * 256];
#pragma unroll
  for (int j = 0; j < P; ++j) if (base + j * 256 < n) d[base + j * 256] = v[j];
}
#define COPY(name, A, P) extern "C" __global__ void name(const A* q, A* qo, long long nq, \
    const A* k, A* ko, long long nk, long long q_blocks) { \
  copy_blocks<A, P>(q, qo, nq, k, ko, nk, q_blocks); }
COPY(copy_16x1, int4, 1)
COPY(copy_16x2, int4, 2)
COPY(copy_16x4, int4, 4)
COPY(copy_8x1, int2, 1)
// A thread per (row of 128 elements, 8-byte chunk of its first half): 8 bytes of each half;
// 16 rows a block.
extern "C" __global__ void copy_pair_8(const int2* q, int2* qo, long long rq, const int2* k,
                                       int2* ko, long long rk, long long q_blocks) {
  long long blk = blockIdx.x;
  const int2* s = q; int2* d = qo; long long rows = rq;
  if (blk >= q_blocks) { blk -= q_blocks; s = k; d = ko; rows = rk; }
  const long long row = blk * 16 + threadIdx.x / 16;
  const int c = threadIdx.x % 16;
  if (row >= rows) return;
  const int2 a = s[row * 32 + c], b = s[row * 32 + 16 + c];
  d[row * 32 + c] = a;
  d[row * 32 + 16 + c] = b;
}
// The rotation in that pattern: bf16 rotate-half rows of 128 elements, half-width bf16 tables
// [L, 64], token t of a row at position t % S (bshd, positions 0..S-1); 4 elements of each half
// a thread, 16 rows a block, heads: q's or k's head count. fastrope's math: fp32, one FMA an
// output (x0 c - x1 s, x1 c + x0 s), rounded once. Out of place or in place (dst == src).
__device__ __forceinline__ void unpack4(uint2 w, float (&f)[4]) {
  f[0] = __uint_as_float(w.x << 16); f[1] = __uint_as_float(w.x & 0xffff0000u);
  f[2] = __uint_as_float(w.y << 16); f[3] = __uint_as_float(w.y & 0xffff0000u);
}
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
extern "C" __global__ void rope_pair_8(const uint2* q, uint2* qo, long long rq, int hq,
                                       const uint2* k, uint2* ko, long long rk, int hk,
                                       long long q_blocks, const uint2* __restrict__ cos,
                                       const uint2* __restrict__ sin, int seqlen) {
  long long blk = blockIdx.x;
  const uint2* s = q; uint2* d = qo; long long rows = rq; unsigned heads = hq;
  if (blk >= q_blocks) { blk -= q_blocks; s = k; d = ko; rows = rk; heads = hk; }
  const long long row = blk * 16 + threadIdx.x / 16;
  const int c = threadIdx.x % 16;
  if (row >= rows) return;
  const unsigned pos = (unsigned)(row / heads) % (unsigned)seqlen;
  const uint2 a = s[row * 32 + c], b = s[row * 32 + 16 + c];
  const uint2 cw = cos[pos * 16 + c], sw = sin[pos * 16 + c];
  float x0[4], x1[4], cf[4], sf[4], o0[4], o1[4];
  unpack4(a, x0); unpack4(b, x1); unpack4(cw, cf); unpack4(sw, sf);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o0[i] = fmaf(x0[i], cf[i], x1[i] * -sf[i]);
    o1[i] = fmaf(x1[i], cf[i], x0[i] * sf[i]);
  }
  d[row * 32 + c] = make_uint2(pack2(o0[0], o0[1]), pack2(o0[2], o0[3]));
  d[row * 32 + 16 + c] = make_uint2(pack2(o1[0], o1[1]), pack2(o1[2], o1[3]));
}
"""
ROTATION = "rope_pair_8"
# column -> (kernel, access bytes, accesses a thread, 16 rows a block instead of accesses)
COPIES = {
    "1 x 16 B a thread": ("copy_16x1", 16, 1, False),
    "2 x 16 B a thread": ("copy_16x2", 16, 2, False),
    "4 x 16 B a thread": ("copy_16x4", 16, 4, False),
    "8 B of each half": ("copy_pair_8", 8, 1, True),
    "1 x 8 B a thread": ("copy_8x1", 8, 1, False),
}
ROWS = ("fastrope.rope", "fastrope.rope_inplace", "minimal kernel", "flash_attn.apply_rotary",
        "flash_attn.apply_rotary_inplace")
ROTATIONS = ("rotation, 8 B of each half", "rotation in place")
COLUMNS = ["case", "fastrope", "fastrope in place", "minimal kernel", "flash-attn",
           "flash-attn in place", *COPIES, "torch copy", *ROTATIONS]
MINIMAL = experiment.Variant(traffic_only=True)


def cases():
    peers = [c for c in get_suite("peers") if c.dtype == "bf16" and c.style == "rotate_half"
             and (c.batch, c.seqlen) in {(8, 4096), (1, 32768)}]
    q_only = [c for c in get_suite("prefill") if c.dtype == "bf16" and c.layout == "bshd"
              and (c.batch, c.seqlen, c.heads) == (8, 4096, 64)]
    return peers + q_only


def _launch(fn, grid, args):
    """``fn`` on torch's current stream: ``grid`` blocks of 256 threads."""
    import cupy

    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it still wraps
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's stream
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    fn((grid,), (256,), args, stream=stream)


def _module():
    import cupy

    return cupy.RawModule(code=SOURCE, options=("-std=c++17",))


def _rotation_calls(case, inputs) -> dict:
    """The rotation in the pair pattern, out of place and in place, on the case's tensors and
    fastrope's tables; each checked against fastrope's output: a cell is "differs" where it is
    not equal bit for bit."""
    import cupy

    kw = registry_arguments(case, inputs)
    q, k = inputs.xs[0], (inputs.xs[1] if len(inputs.xs) > 1 else inputs.xs[0][:, :, :0])
    want = experiment.apply_rope(*inputs.xs, **kw)
    want = want if isinstance(want, tuple) else (want,)
    fn = _module().get_function(ROTATION)

    def ptr(t):
        return cupy.uint64(t.data_ptr())

    rq, rk = q.numel() // 128, k.numel() // 128
    q_blocks, k_blocks = -(-rq // 16), -(-rk // 16)
    calls = {}
    for column, in_place in (("rotation, 8 B of each half", False),
                             ("rotation in place", True)):
        qo, ko = (q.clone(), k.clone()) if in_place else (torch.empty_like(q),
                                                          torch.empty_like(k))
        qi, ki = (qo, ko) if in_place else (q, k)
        args = (ptr(qi), ptr(qo), cupy.int64(rq), cupy.int32(q.shape[2]), ptr(ki), ptr(ko),
                cupy.int64(rk), cupy.int32(k.shape[2]), cupy.int64(q_blocks), ptr(kw["cos"]),
                ptr(kw["sin"]), cupy.int32(q.shape[1]))
        # the closure holds the tensors: the kernel has only their addresses
        calls[column] = (lambda g=q_blocks + k_blocks, a=args, held=(qi, ki, qo, ko, kw):
                         _launch(fn, g, a))
        calls[column]()
        if not all(torch.equal(o, w) for o, w in zip((qo, ko), want)):
            calls[column] = "differs"
    return calls


def _copy_calls(q, k) -> dict:
    """The copy kernels on q (and k): each checked to copy exactly."""
    import cupy

    module = _module()
    k = k if k is not None else q[:, :, :0]  # q only: an empty k
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    launch = _launch
    calls = {}
    for column, (name, size, per_thread, rows) in COPIES.items():
        # accesses (or 128-element rows) of each tensor, and the blocks that cover them
        per = (lambda t: t.numel() // 128) if rows else (lambda t: t.numel() * 2 // size)
        unit = 16 if rows else 256 * per_thread
        nq, nk = per(q), per(k)
        q_blocks, k_blocks = -(-nq // unit), -(-nk // unit)
        args = (cupy.uint64(q.data_ptr()), cupy.uint64(qo.data_ptr()), cupy.int64(nq),
                cupy.uint64(k.data_ptr()), cupy.uint64(ko.data_ptr()),
                cupy.int64(nk), cupy.int64(q_blocks))
        # the closure holds the outputs: the kernel has only their addresses
        calls[column] = (lambda fn=module.get_function(name), g=q_blocks + k_blocks, a=args,
                         outs=(qo, ko): launch(fn, g, a))
        qo.fill_(float("nan"))
        ko.fill_(float("nan"))
        calls[column]()
        assert torch.equal(qo, q) and torch.equal(ko, k), f"{column}: not a copy"
    return calls


def _calls(case, inputs) -> dict:
    calls = {}
    for name in ROWS:
        if name == "minimal kernel":
            kw = registry_arguments(case, inputs)
            calls[name] = lambda kw=kw: experiment.apply_rope(*inputs.xs, variant=MINIMAL, **kw)
            continue
        spec = registry.get(name)
        missing = getattr(spec, "missing", None)  # peers: None when installed
        if spec.unsupported_reason(case) is None and not (missing and missing()):
            calls[name] = spec.prepare(case, inputs)
    xs = inputs.xs
    calls.update(_copy_calls(xs[0], xs[1] if len(xs) > 1 else None))
    calls.update(_rotation_calls(case, inputs))
    return calls


def main(argv=None) -> int:
    ap = probe_parser("tools.traffic_pattern_probe", __doc__, reps=3)
    args = parse_probe_arguments(ap, argv)
    require_gpu(ap)
    rows = []
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for case in cases():
        inputs = make_inputs(case, 0, torch.device("cuda"))
        calls = _calls(case, inputs)
        wrong = {n for n, c in calls.items() if c == "differs"}
        times = min_of_interleaved({n: c for n, c in calls.items() if n not in wrong},
                                   reps=args.reps, timer=graph_median_us)
        times["torch copy"] = copy_us(case.io_bytes() // 2, graph=True)
        times.update((n, "differs") for n in wrong)
        keys = [*ROWS, *COPIES, "torch copy", *ROTATIONS]
        rows.append([case.describe(), *("-" if times.get(n) is None else
                                        times[n] if isinstance(times[n], str) else
                                        f"{times[n]:.1f}" for n in keys)])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
        del inputs
        torch.cuda.empty_cache()
    write_requested(args, argv, tool="tools.traffic_pattern_probe", doc=__doc__,
                    section="the H200's large prefills against copy kernels of several traffic "
                            "patterns", columns=COLUMNS, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
