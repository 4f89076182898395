"""``compare.py --overhead`` (a benchmark, not a test): the adapter's host time per call on a tiny
input, next to a bare CuPy RawKernel launch of the same kernel. Needs an NVIDIA GPU.

Host time per call = wall time of N back-to-back calls / N, with the GPU work tiny enough that
the host, not the GPU, sets the pace (checked: the GPU time per call is printed too).
"""
from __future__ import annotations

import time

import torch

CALLS = 20000


def _per_call_us(fn, calls: int = CALLS) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def measure() -> dict[str, float]:
    import numpy as np

    from ports import _cupy, leetcuda

    cp = _cupy.cupy()
    x = torch.randn(4, 64, device="cuda")
    out = torch.empty_like(x)
    results = {"adapter: leetcuda.rope_f32(x, out)": _per_call_us(lambda: leetcuda.rope_f32(x, out))}

    raw = cp.RawKernel(leetcuda.MODULE.source, "rope_f32_kernel", options=("--use_fast_math",))
    xc = cp.random.standard_normal((4, 64), dtype=cp.float32)
    oc = cp.empty_like(xc)
    args = (xc, oc, np.int32(4), np.int32(32))
    results["bare cupy.RawKernel launch"] = _per_call_us(lambda: raw((1,), (256,), args))

    fn = leetcuda.MODULE.function("rope_f32_kernel", x.get_device())
    stream = _cupy._external_stream(_cupy._current_raw_stream(x.get_device()), x.get_device())
    pargs = (_cupy.ptr(x), _cupy.ptr(out), np.int32(4), np.int32(32))
    results["cached Function, torch stream, no checks"] = _per_call_us(
        lambda: fn((1,), (256,), pargs, stream=stream))

    from ports import fastrope

    q = torch.randn(1, 1, 4, 64, device="cuda")
    cos, sin = torch.randn(16, 64, device="cuda"), torch.randn(16, 64, device="cuda")
    results["fastrope.apply_rope_inplace(q, cos=, sin=)"] = _per_call_us(
        lambda: fastrope.apply_rope_inplace(q, cos=cos, sin=sin))
    results["fastrope.apply_rope(q, cos=, sin=) (allocates its output)"] = _per_call_us(
        lambda: fastrope.apply_rope(q, cos=cos, sin=sin))
    results["(torch.empty_like(q) alone)"] = _per_call_us(lambda: torch.empty_like(q))
    k = torch.randn(1, 1, 2, 64, device="cuda")
    results["fastrope.apply_rope_inplace(q, k, computed angles)"] = _per_call_us(
        lambda: fastrope.apply_rope_inplace(q, k))

    # The registered op through the dispatcher, and the per-call cost under torch.compile.
    op_args = (None, cos, sin, None, None, 0, None, None, "rotate_half", "bshd", None, 10000.0,
               None, True)
    results["torch.ops.fastrope.rope_(q, ...) (the op, eager dispatch)"] = _per_call_us(
        lambda: torch.ops.fastrope.rope_(q, *op_args))
    compiled_inplace = torch.compile(lambda t: fastrope.apply_rope_inplace(t, cos=cos, sin=sin),
                                     fullgraph=True)
    results["compiled fastrope.apply_rope_inplace(q, cos=, sin=) (fullgraph)"] = _per_call_us(
        lambda: compiled_inplace(q))
    compiled_rope = torch.compile(lambda t: fastrope.apply_rope(t, cos=cos, sin=sin),
                                  fullgraph=True)
    results["compiled fastrope.apply_rope(q, cos=, sin=) (fullgraph)"] = _per_call_us(
        lambda: compiled_rope(q))
    compiled_add = torch.compile(lambda t: t.add_(0), fullgraph=True)
    results["(compiled t.add_(0) alone: a compiled call's own cost)"] = _per_call_us(
        lambda: compiled_add(q))

    from ports.harness.timing import median_us

    results["(GPU time of one launch)"] = median_us(lambda: leetcuda.rope_f32(x, out))
    return results


def table() -> str:
    """The measured host times as a titled table."""
    from tabulate import tabulate

    rows = [[k, f"{v:.1f}"] for k, v in measure().items()]
    return (f"## host time per call, tiny input (x[4, 64] fp32), {torch.cuda.get_device_name()}\n"
            + tabulate(rows, headers=["what", "us per call"], tablefmt="github",
                       disable_numparse=True))
