"""What a run produces: one :class:`Result` per implementation and case, and a case's
:class:`CaseReport`. Plain records, below everything that fills them (:mod:`~ports.harness.runner`,
:mod:`~ports.harness.metrics`) or prints them (:mod:`~ports.harness.report`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from reference.case import RopeCase

Status = Literal["ok", "FAIL", "unsupported", "error", "OOM"]


@dataclass
class Result:
    """One cell row: an implementation on a case. Numbers are ``None`` where ``reason`` says why."""

    impl: str
    family: str
    kind: str
    status: Status
    reason: str = ""               # why it is not ok / not timed
    max_abs_err: float | None = None
    max_rel_err: float | None = None   # max |out - ref| / max |ref| (normwise)
    err_over_tol: float | None = None  # max |out - ref| / tol, element-wise; <= 1 passes
    median_us: float | None = None
    graph_us: float | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    pct_size_copy: float | None = None  # % of the speed of a copy moving the same bytes
    graph_pct_size_copy: float | None = None  # the same, both replayed from CUDA graphs
    speedup: float | None = None       # baseline time / this time
    vs_compile: float | None = None    # this time / torch.compile's (< 1: faster)
    graph_vs_compile: float | None = None  # the same from graph_us
    vs_fastest: float | None = None    # this time / the case's fastest time (1 = fastest)
    graph_vs_fastest: float | None = None  # the same from graph_us
    timing_note: str = ""              # why there is no time, when status is ok
    graph_note: str = ""               # why a timed row has no CUDA-graph time (its capture failed)
    gradient_note: str = ""            # a backward that wrote into its incoming gradient
    host_bound: bool = False           # the event time is the host's (metrics.is_host_bound)
    note: str = ""                     # work done outside the timed call (a peer's given_less_work)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class CaseReport:
    case: RopeCase
    results: list[Result]
    copy_gbps: float | None
    baseline: str | None
    copy_same_us: float | None = None  # a device copy moving the case's io_bytes
    copy_same_graph_us: float | None = None  # the same copy replayed from a CUDA graph

    @property
    def failed(self) -> bool:
        return any(r.status in ("FAIL", "error") for r in self.results)
