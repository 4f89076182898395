"""A candidate design for the fused QK-norm's per-head backward: a CUDA kernel of head rows, not
a Triton token loop (needs a GPU).

The package's per-head backward is a Triton kernel whose programs each take a block of 16 heads
through a loop over tokens, 3-4 programs an SM at 128 registers a thread (DESIGN.md, "Fused
QK-norm + RoPE"). Its minimal kernel says the structure, not the arithmetic, keeps it from a
copy's time. This probe asks whether the design of fastrope's rows kernel would do better:

* 8 threads a head row of 128 (bf16), each owning 8 channels of each half (the rotate-half pair,
  16-byte loads and stores), ``ROWS`` rows a thread in flight;
* blocks of 256 threads, as many an SM as the variant compiles its registers for (2-4), split
  between q and k by their rows; a block takes rows block, block + blocks, ... so the blocks
  running at one time read neighbouring rows;
* a row's two sums by warp shuffles across its 8 threads; dw's sums per thread in registers
  (its channels are fixed), then over the block's 32 row slots in shared memory into one fp32
  partial row a block, which the package's reduction (``qknorm.weight_grads``) sums.

Deterministic as the package's: every sum in a fixed order. Scope of the probe: bf16 q and k
contiguous ``[b, s, h, 128]``, rotate-half, fp32 half-width tables (the suite's), a token at its
position in the sequence, no Gemma offset. Each variant's dq and dk are checked against
``qknorm.backward`` (the design) to one bf16 ulp, its weight gradients to 1% of their largest
element. Rows, CUDA-graph us, the minimum of the interleaved medians: the design; each variant,
its reduction included; a same-size copy of the bytes (dy, q and k read, dq and dk written).

    python -m tools.qknorm_rows_backward_probe [--shapes NAME ...] [--json FILE --commit SHA]
"""
from __future__ import annotations

import functools

import torch

from ports.fastrope import qknorm
from ports.harness import qknorm_bench as bench
from ports.harness.timing import copy_us, graph_median_us, min_of_interleaved
from tools._probe_kit import parse_probe_arguments, probe_parser, qknorm_shapes, write_requested

SHAPES = ["qwen3-8b prefill 4k", "qwen3-8b train 4x4k", "qwen3-8b prefill 32k"]
# (rows a thread, blocks an SM): the grid, and the register bound each launch compiles for;
# STAGED: (stages, blocks an SM) of the kernel that stages its rows by cp.async
VARIANTS = [(1, 2), (1, 3), (2, 2)]
STAGED = [(2, 2), (3, 2), (2, 3), (4, 1)]
THREADS = 256
D = 128

SOURCE = r"""
typedef unsigned short bf16_t;
__device__ __forceinline__ float bf(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ unsigned rne(float f) {  // fp32 -> bf16 bits, nearest even
    unsigned u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ void unpack(uint4 v, float* o) {
    unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) { o[2 * i] = bf(w[i] & 0xffffu); o[2 * i + 1] = bf(w[i] >> 16); }
}
__device__ __forceinline__ uint4 pack(const float* o) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = rne(o[2 * i]) | (rne(o[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ float row_sum(float v) {  // over the 8 lanes of a row
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v;
}

// Grid (q blocks + k blocks), 256 threads: 32 row slots of 8 threads. Row r of a tensor of H
// heads is token r / H, head r % H; its position is token % S. The block's tensor:
struct Side {
    const uint4* x; const uint4* g; uint4* dx; const float* w; float* part;
    long long rows, step, first; int H, blk;
};
#define ROWS_BWD_ARGS                                                                          \
        const uint4* __restrict__ q, const uint4* __restrict__ k,                               \
        const uint4* __restrict__ gq, const uint4* __restrict__ gk,                             \
        uint4* __restrict__ dq, uint4* __restrict__ dk,                                         \
        const float* __restrict__ qw, const float* __restrict__ kw,                             \
        float* __restrict__ qpart, float* __restrict__ kpart,                                   \
        const float4* __restrict__ cos, const float4* __restrict__ sin,                         \
        long long q_rows, long long k_rows, int hq, int hk, int S, int q_blocks, int k_blocks,  \
        float eps
__device__ __forceinline__ Side side_of(const uint4* q, const uint4* k, const uint4* gq,
        const uint4* gk, uint4* dq, uint4* dk, const float* qw, const float* kw, float* qpart,
        float* kpart, long long q_rows, long long k_rows, int hq, int hk, int q_blocks,
        int k_blocks) {
    const bool is_q = blockIdx.x < q_blocks;
    Side sd;
    sd.blk = is_q ? blockIdx.x : blockIdx.x - q_blocks;
    sd.x = is_q ? q : k; sd.g = is_q ? gq : gk; sd.dx = is_q ? dq : dk; sd.w = is_q ? qw : kw;
    sd.part = is_q ? qpart : kpart; sd.rows = is_q ? q_rows : k_rows; sd.H = is_q ? hq : hk;
    sd.step = (long long)(is_q ? q_blocks : k_blocks) * 32;
    sd.first = (long long)sd.blk * 32 + (threadIdx.x >> 3);
    return sd;
}

// One row's dx, in place of g1, g2 (x1, x2 become x_hat), and its dz * x_hat into the sums.
__device__ __forceinline__ void row_backward(float* x1, float* x2, float* g1, float* g2,
        const float4* c, const float4* s, const float* w, int t, float eps, bool sums,
        float* acc1, float* acc2) {
    const float cc[8] = {c[0].x, c[0].y, c[0].z, c[0].w, c[1].x, c[1].y, c[1].z, c[1].w};
    const float ss[8] = {s[0].x, s[0].y, s[0].z, s[0].w, s[1].x, s[1].y, s[1].z, s[1].w};
    float sq = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) sq += x1[i] * x1[i] + x2[i] * x2[i];
    const float rstd = rsqrtf(row_sum(sq) / 128.f + eps);
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        x1[i] *= rstd; x2[i] *= rstd;                 // x_hat
        const float dz1 = g1[i] * cc[i] + g2[i] * ss[i];
        const float dz2 = g2[i] * cc[i] - g1[i] * ss[i];
        if (sums) { acc1[i] += dz1 * x1[i]; acc2[i] += dz2 * x2[i]; }
        g1[i] = dz1 * __ldg(w + t * 8 + i);            // d x_hat (the weights from L1)
        g2[i] = dz2 * __ldg(w + 64 + t * 8 + i);
        dot += g1[i] * x1[i] + g2[i] * x2[i];
    }
    dot = row_sum(dot) / 128.f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        g1[i] = rstd * (g1[i] - x1[i] * dot); g2[i] = rstd * (g2[i] - x2[i] * dot);
    }
}

// The block's sums over its 32 row slots, in a fixed order, as its partial row; ``red`` holds
// 32 x 129 floats (the callers' shared memory).
__device__ __forceinline__ void write_partial(float (*red)[129], const float* acc1,
        const float* acc2, float* part, int blk) {
    const int t = threadIdx.x & 7, slot = threadIdx.x >> 3;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        red[slot][t * 8 + i] = acc1[i];
        red[slot][64 + t * 8 + i] = acc2[i];
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        float v = 0.f;
        for (int j = 0; j < 32; j++) v += red[j][threadIdx.x];
        part[(long long)blk * 128 + threadIdx.x] = v;
    }
}

template <int ROWS, int MIN_BLOCKS>
__global__ void __launch_bounds__(256, MIN_BLOCKS) rows_bwd(ROWS_BWD_ARGS) {
    const Side sd = side_of(q, k, gq, gk, dq, dk, qw, kw, qpart, kpart, q_rows, k_rows, hq, hk,
                            q_blocks, k_blocks);
    const int t = threadIdx.x & 7;
    float acc1[8] = {}, acc2[8] = {};
    for (long long base = sd.first; base < sd.rows; base += sd.step * ROWS) {
        uint4 vx1[ROWS], vx2[ROWS], vg1[ROWS], vg2[ROWS];
        float4 c[ROWS][2], s[ROWS][2];
        bool ok[ROWS];
#pragma unroll
        for (int u = 0; u < ROWS; u++) {  // every row's loads before any row's math
            long long r = base + u * sd.step;
            ok[u] = r < sd.rows;
            long long rr = ok[u] ? r : base;
            const long long e = rr * 16 + t;  // in uint4 (8 bf16): a row is 16 of them
            vx1[u] = sd.x[e]; vx2[u] = sd.x[e + 8]; vg1[u] = sd.g[e]; vg2[u] = sd.g[e + 8];
            long long pos = (rr / sd.H) % S;
            c[u][0] = cos[pos * 16 + t * 2]; c[u][1] = cos[pos * 16 + t * 2 + 1];
            s[u][0] = sin[pos * 16 + t * 2]; s[u][1] = sin[pos * 16 + t * 2 + 1];
        }
#pragma unroll
        for (int u = 0; u < ROWS; u++) {
            float x1[8], x2[8], g1[8], g2[8];
            unpack(vx1[u], x1); unpack(vx2[u], x2); unpack(vg1[u], g1); unpack(vg2[u], g2);
            row_backward(x1, x2, g1, g2, c[u], s[u], sd.w, t, eps, ok[u], acc1, acc2);
            if (ok[u]) {
                const long long e = (base + u * sd.step) * 16 + t;
                sd.dx[e] = pack(g1); sd.dx[e + 8] = pack(g2);
            }
        }
    }
    __shared__ float red[32][129];
    write_partial(red, acc1, acc2, sd.part, sd.blk);
}

// rows_bwd with a thread's rows staged in shared memory STAGES - 1 rows ahead by cp.async (its
// x and dy chunks, and its table chunks), so the bytes in flight hold no registers. A thread
// reads back only what it copied itself: cp.async.wait_group orders that, with no barrier.
__device__ __forceinline__ void cp16(void* dst, const void* src, bool table) {
    unsigned a = (unsigned)__cvta_generic_to_shared(dst);
    if (table) asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" :: "r"(a), "l"(src));
    else asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(a), "l"(src));
}
template <int STAGES, int MIN_BLOCKS>
__global__ void __launch_bounds__(256, MIN_BLOCKS) rows_bwd_staged(ROWS_BWD_ARGS) {
    extern __shared__ uint4 stage[];  // [STAGES][8 chunks][256 threads]: no bank conflicts
    const Side sd = side_of(q, k, gq, gk, dq, dk, qw, kw, qpart, kpart, q_rows, k_rows, hq, hk,
                            q_blocks, k_blocks);
    const int t = threadIdx.x & 7;
    float acc1[8] = {}, acc2[8] = {};
    auto issue = [&](long long i) {
        const long long r = sd.first + i * sd.step;
        if (r < sd.rows) {
            uint4* d = stage + (i % STAGES) * 2048 + threadIdx.x;
            const long long e = r * 16 + t;
            const long long c = (r / sd.H) % S * 16 + t * 2;
            cp16(d, sd.x + e, false); cp16(d + 256, sd.x + e + 8, false);
            cp16(d + 512, sd.g + e, false); cp16(d + 768, sd.g + e + 8, false);
            cp16(d + 1024, cos + c, true); cp16(d + 1280, cos + c + 1, true);
            cp16(d + 1536, sin + c, true); cp16(d + 1792, sin + c + 1, true);
        }
        asm volatile("cp.async.commit_group;");
    };
#pragma unroll
    for (int p = 0; p < STAGES - 1; p++) issue(p);
    for (long long i = 0; sd.first + i * sd.step < sd.rows; i++) {
        issue(i + STAGES - 1);
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1));
        const uint4* d = stage + (i % STAGES) * 2048 + threadIdx.x;
        float x1[8], x2[8], g1[8], g2[8];
        unpack(d[0], x1); unpack(d[256], x2); unpack(d[512], g1); unpack(d[768], g2);
        const float4 c[2] = {reinterpret_cast<const float4&>(d[1024]),
                             reinterpret_cast<const float4&>(d[1280])};
        const float4 s[2] = {reinterpret_cast<const float4&>(d[1536]),
                             reinterpret_cast<const float4&>(d[1792])};
        row_backward(x1, x2, g1, g2, c, s, sd.w, t, eps, true, acc1, acc2);
        const long long e = (sd.first + i * sd.step) * 16 + t;
        sd.dx[e] = pack(g1); sd.dx[e + 8] = pack(g2);
    }
    asm volatile("cp.async.wait_all;");
    __syncthreads();
    write_partial(reinterpret_cast<float (*)[129]>(stage), acc1, acc2, sd.part, sd.blk);
}
"""


@functools.lru_cache(maxsize=None)
def _kernel(name: str, a: int, blocks_per_sm: int, smem: int = 0):
    import cupy

    name = f"{name}<{a}, {blocks_per_sm}>"
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=[name])
    fn = module.get_function(name)
    if smem:
        fn.max_dynamic_shared_size_bytes = smem
    return fn


def rows_backward(dq_out, dk_out, q, k, qw, kw, qw32, kw32, cos, sin, *, rows: int,
                  blocks_per_sm: int, stages: int = 0):
    """(dq, dk, dq_weight, dk_weight) by the candidate design (the probe's scope only);
    ``qw32``, ``kw32``: the weights in fp32, as the kernel reads them (made once, outside);
    ``stages``: the staged kernel with that many (``rows`` unused), else the plain one."""
    import cupy
    import numpy as np

    b, s, hq, d = q.shape
    hk = k.shape[2]
    q_rows, k_rows = b * s * hq, b * s * hk
    # a warp's 4 row slots leave the loop together (its shuffles take every lane)
    assert d == D and q.dtype == torch.bfloat16 and cos.shape[-1] == D // 2
    assert q_rows % 32 == 0 and k_rows % 32 == 0
    total = torch.cuda.get_device_properties(q.device).multi_processor_count * blocks_per_sm
    q_blocks = max(1, round(total * q_rows / (q_rows + k_rows)))
    k_blocks = max(1, total - q_blocks)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    qpart = torch.empty(q_blocks, D, device=q.device)
    kpart = torch.empty(k_blocks, D, device=q.device)
    p = [np.uint64(t.data_ptr()) for t in (q, k, dq_out, dk_out, dq, dk, qw32, kw32, qpart,
                                           kpart, cos, sin)]
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    smem = stages * THREADS * 8 * 16
    fn = (_kernel("rows_bwd_staged", stages, blocks_per_sm, smem) if stages
          else _kernel("rows_bwd", rows, blocks_per_sm))
    fn((q_blocks + k_blocks,), (THREADS,),
       (*p, np.int64(q_rows), np.int64(k_rows), np.int32(hq), np.int32(hk),
        np.int32(s), np.int32(q_blocks), np.int32(k_blocks), np.float32(bench.EPS)),
       stream=stream, shared_mem=smem if stages else 0)
    return (dq, dk) + qknorm.weight_grads(qpart, kpart, qw, kw)


def _check(got, want, label: str) -> None:
    for i, (a, e) in enumerate(zip(got, want)):
        a, e = a.float(), e.float()
        floor = 0.01 * float(e.abs().max()) if i >= 2 else 2**-8 * float(e.abs().max())
        try:
            torch.testing.assert_close(a, e, rtol=2**-7, atol=floor)
        except AssertionError as err:
            raise SystemExit(f"{label}: output {i} differs from qknorm.backward's: "
                             f"{str(err).splitlines()[0]}") from None


def probe(shape, reps: int) -> list[str]:
    q, k, qw, kw, cos, sin = bench.inputs(shape, torch.bfloat16, grad=False)
    cos, sin = bench.fastrope_tables(cos, sin)
    gen = torch.Generator(device="cuda").manual_seed(1)
    dq_out, dk_out = (torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
                      for x in (q, k))
    kwargs = dict(cos=cos, sin=sin, positions=None, style="rotate_half", layout="bshd",
                  rotary_dim=None, base=10000.0, gemma=False)

    def design():
        return qknorm.backward(dq_out, dk_out, q, k, qw, kw, bench.EPS, **kwargs)

    calls = {"design": design}
    want = design()
    for rows, bps in VARIANTS:
        call = functools.partial(rows_backward, dq_out, dk_out, q, k, qw, kw, qw.float(),
                                 kw.float(), cos, sin, rows=rows, blocks_per_sm=bps)
        _check(call(), want, f"{shape.name}, {rows} rows a thread, {bps} blocks an SM")
        calls[(rows, bps)] = call
    for stages, bps in STAGED:
        call = functools.partial(rows_backward, dq_out, dk_out, q, k, qw, kw, qw.float(),
                                 kw.float(), cos, sin, rows=1, blocks_per_sm=bps, stages=stages)
        _check(call(), want, f"{shape.name}, staged {stages} rows, {bps} blocks an SM")
        calls[("staged", stages, bps)] = call
    us = min_of_interleaved(calls, reps=reps, timer=graph_median_us)
    moved = 3 * (q.numel() + k.numel()) * q.element_size() // 2  # copy_us moves 2x this
    same = copy_us(moved, graph=True)
    cells = [f"{us[c]:.1f} ({100 * same / us[c]:.0f}%)" for c in calls]
    return [shape.name, *cells, f"{same:.1f}"]


def main(argv=None) -> int:
    ap = probe_parser("tools.qknorm_rows_backward_probe", __doc__, reps=5)
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    args = parse_probe_arguments(ap, argv)
    shapes = qknorm_shapes(ap, args.shapes)
    columns = ["shape", "design (us, % copy)",
               *(f"rows kernel, {r} row{'s' if r > 1 else ''} a thread, {b} blocks an SM"
                 for r, b in VARIANTS),
               *(f"rows staged by cp.async, {st} stages, {b} block{'s' if b > 1 else ''} an SM"
                 for st, b in STAGED), "same-size copy (us)"]
    rows = []
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for shape in shapes:
        rows.append(probe(shape, args.reps))
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    write_requested(args, argv, tool="tools.qknorm_rows_backward_probe", doc=__doc__,
                    section="a CUDA rows kernel for the fused QK-norm's per-head backward",
                    columns=columns, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
