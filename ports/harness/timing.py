"""GPU timing: CUDA events through ``triton.testing.do_bench`` (median), optionally CUDA graphs.

``do_bench`` zeroes a 256 MB buffer before every repetition, so each call starts with a cold L2;
its ``warmup`` and ``rep`` budgets are milliseconds.
"""
from __future__ import annotations

import functools
import statistics

import torch

# the backward alone, a call that carries its capture stream (graph_median_us); public here
from ports._adapters import backward_alone  # noqa: F401

WARMUP_MS = 25
REP_MS = 100
COPY_BYTES = 1 << 30  # 1 GiB source: 2 GiB moved, far larger than any L2 (50 MB on H100)
# A copy runs as device-to-device copies of at most this many bytes each: replayed from a CUDA
# graph, a single copy of 512 MiB or more ran slower than the same bytes in pieces, while event
# timing ran both alike (results/README.md, the peers, prefill and backward suites section).
COPY_PIECE_BYTES = 256 << 20


def median_us(fn, *, warmup_ms: int = WARMUP_MS, rep_ms: int = REP_MS) -> float:
    """Median time of ``fn()`` in microseconds, CUDA-event timed after warm-up."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def graph_median_us(fn, *, rep_ms: int = REP_MS) -> float:
    """Median time per call of ``fn()`` replayed from a CUDA graph, in microseconds.

    The method of ``triton.testing.do_bench_cudagraph``: a warm-up call, an estimate from 5
    calls, as many calls as fill ``rep_ms`` captured into one graph, the median of 10 replays,
    each replay's time divided by its calls. Unlike it, the capture stream may be the call's own:
    a call with a ``capture_stream`` (``ports._adapters.backward_alone``: a backward, which
    autograd runs on its forward's stream) is warmed up and captured on that stream, any other
    on a new one."""
    stream = getattr(fn, "capture_stream", None) or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = start.elapsed_time(end) / 5
    calls = max(1, int(rep_ms / estimate_ms)) if estimate_ms > 0 else 1000
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls * 1e3)
    del graph
    return statistics.median(times)


@functools.cache
def copy_bandwidth_gbps(device_index: int = 0, nbytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth, GB/s counting bytes read plus bytes written."""
    from ports.harness.metrics import gbps

    return gbps(2 * nbytes, copy_us(nbytes, device_index))


def copy_us(nbytes: int, device_index: int = 0, *, graph: bool = False) -> float:
    """Median time of a device-to-device copy of ``nbytes`` (2 x nbytes moved), in microseconds,
    event timed (``graph``: replayed from a CUDA graph); its buffers are freed before it
    returns."""
    with torch.cuda.device(device_index):
        us = (graph_median_us if graph else median_us)(copy_of(nbytes))
        torch.cuda.empty_cache()
    return us


def copy_of(nbytes: int):
    """A call that copies ``nbytes`` (half the bytes moved) device to device, on random data, in
    pieces of at most COPY_PIECE_BYTES; its ``args`` are ``(dst, src)``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    pieces = list(zip(dst.split(COPY_PIECE_BYTES // 2), src.split(COPY_PIECE_BYTES // 2)))

    def copy():
        for d, s in pieces:
            d.copy_(s)

    copy.args = (dst, src)
    return copy


def min_of_interleaved(calls: dict, reps: int = 3, timer=median_us) -> dict:
    """The minimum over ``reps`` rounds of each call's ``timer`` (a median), the rounds
    interleaved across the calls: a clock or neighbour drift during one call's timing moves
    every call alike instead of one."""
    times = {k: [] for k in calls}
    for _ in range(reps):
        for k, f in calls.items():
            times[k].append(timer(f))
    return {k: min(v) for k, v in times.items()}


def paired_summary(pairs) -> dict[str, float]:
    """``(own, candidate)`` times taken in the same rounds: each one's median over the rounds
    (``own_us``, ``us``) and the median of the rounds' ratios (``ratio``: candidate over own)."""
    pairs = list(pairs)
    return dict(own_us=round(statistics.median(o for o, _ in pairs), 2),
                us=round(statistics.median(t for _, t in pairs), 2),
                ratio=round(statistics.median(t / o for o, t in pairs), 4))
