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
suite's q-only 8x4096x64 bf16. CUDA-graph us, the minimum of interleaved medians; every copy
kernel's output is checked to equal its input.

    python -m tools.traffic_pattern_probe [--reps 3] [--json FILE --commit SHA]
"""
from __future__ import annotations

import argparse
import warnings

import torch

from ports import registry
from ports.fastrope import experiment
from ports.harness.suites import get_suite
from ports.harness.timing import copy_us, graph_median_us, min_of_interleaved
from reference.case import make_inputs
from tools._probe_kit import output_arguments, registry_arguments, write_requested

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
"""
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
COLUMNS = ["case", "fastrope", "fastrope in place", "minimal kernel", "flash-attn",
           "flash-attn in place", *COPIES, "torch copy"]
MINIMAL = experiment.Variant(traffic_only=True)


def cases():
    peers = [c for c in get_suite("peers") if c.dtype == "bf16" and c.style == "rotate_half"
             and (c.batch, c.seqlen) in {(8, 4096), (1, 32768)}]
    q_only = [c for c in get_suite("prefill") if c.dtype == "bf16" and c.layout == "bshd"
              and (c.batch, c.seqlen, c.heads) == (8, 4096, 64)]
    return peers + q_only


def _copy_calls(q, k) -> dict:
    """The copy kernels on q (and k): each checked to copy exactly."""
    import cupy

    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
    k = k if k is not None else q[:, :, :0]  # q only: an empty k
    qo, ko = torch.empty_like(q), torch.empty_like(k)

    def launch(fn, grid, args):
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it still wraps
            warnings.simplefilter("ignore", DeprecationWarning)  # torch's stream
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        fn((grid,), (256,), args, stream=stream)

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
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.traffic_pattern_probe",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds (default 3)")
    output_arguments(ap)
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU; none is visible")
    rows = []
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for case in cases():
        inputs = make_inputs(case, 0, torch.device("cuda"))
        times = min_of_interleaved(_calls(case, inputs), reps=args.reps, timer=graph_median_us)
        times["torch copy"] = copy_us(case.io_bytes() // 2, graph=True)
        keys = [*ROWS, *COPIES, "torch copy"]
        rows.append([case.describe(), *("-" if times.get(n) is None else f"{times[n]:.1f}"
                                        for n in keys)])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
        del inputs
        torch.cuda.empty_cache()
    write_requested(args, argv, tool="tools.traffic_pattern_probe", doc=__doc__,
                    section="the H200's large prefills against copy kernels of several traffic "
                            "patterns", columns=COLUMNS, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
