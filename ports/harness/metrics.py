"""Derived metrics, computed in this one place from the measured times of a case's results.

Per result: GB/s (the case's bytes over the event time), % of the device's copy bandwidth, % of
the speed of a copy moving the same bytes (event times, and CUDA-graph times where the case was
replayed), speed-up over the eager baseline, the time (event and
CUDA-graph) over torch.compile's and over the case's fastest, and whether the event time is
host-bound.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ports.harness.result import Result

# The numeric fields of a result that ``compare.py --summary`` can pivot.
SUMMARY_VALUES = ("pct_copy", "pct_size_copy", "graph_pct_size_copy", "median_us", "graph_us",
                  "gbps", "err_over_tol", "vs_compile", "graph_vs_compile", "vs_fastest",
                  "graph_vs_fastest")
# A same-size copy shorter than this is mostly launch latency: the case is tiny, and an event
# time far above the copy's is the host's (Python, checks, launch), not the kernel's.
TINY_COPY_US = 10.0
HOST_BOUND_FACTOR = 2.0


def gbps(nbytes: int, us: float | None) -> float | None:
    """``nbytes`` moved in ``us`` microseconds, in GB/s; ``None`` without a real time."""
    return None if ratio(1.0, us) is None else nbytes / (us * 1e-6) / 1e9


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100.0 * fraction


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den`` where both are real, positive numbers, else ``None``."""
    real = [t is not None and t > 0 and math.isfinite(t) for t in (num, den)]
    return num / den if all(real) else None


def is_host_bound(median_us: float | None, graph_us: float | None,
                  copy_same_us: float | None) -> bool:
    """An event time more than twice the CUDA-graph replay of the same call (where there is one),
    or else, on a tiny case, more than twice a same-size copy: the host set its pace."""
    if median_us is None:
        return False
    if graph_us is not None:
        return median_us > HOST_BOUND_FACTOR * graph_us
    return (copy_same_us is not None and copy_same_us < TINY_COPY_US
            and median_us > HOST_BOUND_FACTOR * copy_same_us)


def derive(results: Sequence[Result], *, io_bytes: int, copy_gbps: float | None = None,
           copy_same_us: float | None = None, copy_same_graph_us: float | None = None,
           baseline: str | None = None, compiled: str | None = None) -> None:
    """Fill every result's derived fields from the times of the case's results (in place).

    ``baseline`` and ``compiled`` name the rows that speed-ups and the "÷ compile" ratios divide
    by (``None``: not in this case, and those fields stay ``None``)."""
    by_name = {r.impl: r for r in results}
    base = by_name.get(baseline) if baseline else None
    comp = by_name.get(compiled) if compiled else None
    fastest = min((r.median_us for r in results if ratio(1.0, r.median_us)), default=None)
    graph_fastest = min((r.graph_us for r in results if ratio(1.0, r.graph_us)), default=None)
    for r in results:
        r.gbps = gbps(io_bytes, r.median_us)
        r.pct_copy = None if r.gbps is None or not copy_gbps else 100.0 * r.gbps / copy_gbps
        r.pct_size_copy = _percent(ratio(copy_same_us, r.median_us))
        r.graph_pct_size_copy = _percent(ratio(copy_same_graph_us, r.graph_us))
        r.speedup = ratio(base.median_us, r.median_us) if base else None
        r.vs_compile = ratio(r.median_us, comp.median_us) if comp else None
        r.graph_vs_compile = ratio(r.graph_us, comp.graph_us) if comp else None
        r.vs_fastest = ratio(r.median_us, fastest)
        r.graph_vs_fastest = ratio(r.graph_us, graph_fastest)
        r.host_bound = is_host_bound(r.median_us, r.graph_us, copy_same_us)
