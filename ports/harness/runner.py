"""Validate, then time: one case against a list of implementations.

For each implementation: skip it with a reason if it does not support the case; otherwise call it
once with outputs poisoned (NaN), compare with the float64 oracle of the inputs it consumed, check
that its inputs are unchanged, and (on a GPU, if it passed) time it. One implementation that
raises never stops the others: its cells carry the error.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ports import _alloc, registry
from ports._adapters import AutogradCall
from ports._spec import ImplSpec
from ports.harness import env, metrics, timing
from ports.harness.result import CaseReport, Result
from reference.case import RopeCase, RopeInputs, make_inputs
from reference.expected import expected, tolerances
from reference.vocabulary import TOKEN_AXIS

# A backward that rotates dy in place and returns it: correct alone, but autograd may hand one
# gradient tensor to two nodes (``x + y``'s backward gives both the same one), and the other
# node then reads rotated values. The row keeps its results; the harness gave it a copy.
GRADIENT_WRITTEN = ("its backward wrote into its incoming gradient (dy): in a graph that hands "
                    "that tensor to another node too (x + y's backward does), the other node's "
                    "gradient is wrong (here it was handed a copy)")


def _short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:160]


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


CHUNK_ELEMENTS = 1 << 25  # validate in token chunks: float64 temporaries stay ~256 MB each


def token_chunks(case: RopeCase, inputs: RopeInputs, max_elements: int = CHUNK_ELEMENTS):
    """``(start, stop)`` ranges along the token axis, each covering <= max_elements per tensor."""
    n = inputs.x.shape[TOKEN_AXIS[case.layout]]
    per_token = max(max(x.numel() for x in inputs.xs) // max(n, 1), 1)
    step = max(1, max_elements // per_token)
    return [(i, min(n, i + step)) for i in range(0, n, step)] or [(0, 0)]


def slice_tokens(case: RopeCase, inputs: RopeInputs, start: int, stop: int) -> RopeInputs:
    """The inputs restricted to tokens ``start:stop`` (views; positions sliced to match)."""
    axis, length = TOKEN_AXIS[case.layout], stop - start
    positions = (inputs.positions[start:stop] if case.layout == "thd"
                 else inputs.positions[:, start:stop])
    cut = (lambda ts: None if ts is None else tuple(t.narrow(axis, start, length) for t in ts))
    return dataclasses.replace(inputs, xs=cut(inputs.xs), grads=cut(inputs.grads),
                               positions=positions)


def check_outputs(case: RopeCase, spec: ImplSpec, inputs: RopeInputs,
                  outs: Sequence[torch.Tensor]) -> Result:
    """Compare outputs with the float64 oracle of what the spec consumed, chunk by chunk of
    tokens (so >2^31-element cases fit); NaN (an unwritten, poisoned element) always fails."""
    result = Result(spec.name, spec.family, spec.kind, "ok")
    if len(outs) != len(inputs.xs):
        result.status = "FAIL"
        result.reason = f"returned {len(outs)} tensors, expected {len(inputs.xs)}"
        return result
    for out, x in zip(outs, inputs.xs):
        if tuple(out.shape) != tuple(x.shape) or out.dtype != case.torch_dtype:
            result.status = "FAIL"
            result.reason = (f"returned {out.dtype} {tuple(out.shape)}, expected "
                             f"{case.torch_dtype} {tuple(x.shape)}")
            return result
    max_abs = max_rel = ratio = 0.0
    axis = TOKEN_AXIS[case.layout]
    for start, stop in token_chunks(case, inputs):
        sub = slice_tokens(case, inputs, start, stop)
        refs = expected(case, sub, spec.table_source)
        tols = tolerances(case, sub, refs, steps=spec.steps(case),
                          angle_rel_err=spec.angle_err(case))
        for out, ref, tol in zip(outs, refs, tols):
            err = (out.narrow(axis, start, stop - start).to(torch.float64) - ref).abs()
            n_bad = int(torch.isnan(err).sum())
            if n_bad:
                result.status = "FAIL"
                result.reason = f"{n_bad} elements NaN (unwritten or invalid)"
                return result
            if not err.numel():
                continue
            scale = float(ref.abs().max())
            e = float(err.max())
            max_abs = max(max_abs, e)
            max_rel = max(max_rel, e / scale if scale else e)
            ratio = max(ratio, float((err / tol).max()))
    result.max_abs_err, result.max_rel_err, result.err_over_tol = max_abs, max_rel, ratio
    if not ratio <= 1.0:
        result.status = "FAIL"
        result.reason = f"max error {max_abs:.3g} exceeds tolerance ({ratio:.3g}x)"
    return result


def run_case(case: RopeCase, specs: Sequence[ImplSpec], *, seed: int = 0,
             targets: frozenset[str] | None = None, device: torch.device | None = None,
             timing_on: bool | None = None, graph: bool = False, progress=None) -> CaseReport:
    """Validate (and time, on a GPU) every spec on fresh inputs for ``case``."""
    targets = env.targets() if targets is None else targets
    device = env.device() if device is None else device
    timing_on = (device.type == "cuda") if timing_on is None else timing_on
    copy_gbps = timing.copy_bandwidth_gbps(device.index or 0) if timing_on else None
    baseline = registry.baseline_for(case, targets)

    try:
        inputs = make_inputs(case, seed, device)
    except Exception as exc:  # e.g. OOM while drawing a huge case
        status = "OOM" if _is_oom(exc) else "error"
        reason = f"{status}: could not build inputs: {_short_error(exc)}"
        results = [Result(s.name, s.family, s.kind, status, reason) for s in specs]
        return CaseReport(case, results, copy_gbps, baseline.name if baseline else None)

    results: list[Result] = []
    for spec in specs:
        if progress is not None:
            progress.set_postfix_str(spec.name, refresh=False)
        results.append(_run_one(case, spec, inputs, targets, timing_on, graph))
        if progress is not None:
            progress.update(1)
    del inputs
    # The baseline's row on top, then the rows that ran, then the unsupported ones (registry
    # order within each).
    results.sort(key=lambda r: (r.status == "unsupported", baseline is None
                                or r.impl != baseline.name))
    # Inputs are freed: a copy of the case's own size (what small cases can reach), once.
    copy_same_us = (timing.copy_us(case.io_bytes() // 2, device.index or 0)
                    if any(r.median_us is not None for r in results) else None)
    # and replayed, where the case's calls were (graph times against a graph time)
    copy_same_graph_us = (timing.copy_us(case.io_bytes() // 2, device.index or 0, graph=True)
                          if any(r.graph_us is not None for r in results) else None)
    compiled = next((s.name for s in specs if s.compile_reference), None)
    metrics.derive(results, io_bytes=case.io_bytes(), copy_gbps=copy_gbps,
                   copy_same_us=copy_same_us, copy_same_graph_us=copy_same_graph_us,
                   baseline=baseline and baseline.name, compiled=compiled)
    return CaseReport(case, results, copy_gbps, baseline.name if baseline else None,
                      copy_same_us, copy_same_graph_us)


def _time_graph(result: Result, fn, case) -> None:
    """``result.graph_us``: ``fn`` (a backward case's: its backward alone) replayed from a CUDA
    graph. A call that cannot be captured (a host sync, work on the legacy default stream, a
    refusal while capturing) keeps its other results and gets the reason in ``graph_note``;
    PyTorch ends the failed capture, so the next rows capture as before."""
    if case.direction == "backward" and not isinstance(fn, AutogradCall):
        return
    try:
        call = fn.backward_alone() if isinstance(fn, AutogradCall) else fn
        result.graph_us = timing.graph_median_us(call)
    except Exception as exc:
        result.graph_note = f"no CUDA-graph time: {_short_error(exc)}"


def _run_one(case, spec, inputs, targets, timing_on, graph) -> Result:
    reason = spec.unsupported_reason(case, targets)
    if reason is None and getattr(spec, "missing", None) is not None:
        reason = spec.missing()  # a peer whose library is not installed here
    if reason is not None:
        return Result(spec.name, spec.family, spec.kind, "unsupported", reason)
    given = [*inputs.xs, *(inputs.grads or ())]  # the case's tensors, which every row reads
    snapshot = [x.clone() for x in given]
    grads = None
    try:
        fn = spec.prepare(case, inputs)
        if isinstance(fn, AutogradCall):  # the gradients this call hands its backward
            grads = [(g, g.clone()) for g in fn.grads]
        with _alloc.poisoned():
            outs = fn()
        result = check_outputs(case, spec, inputs, outs)
        result.note = getattr(spec, "given_less_work", "")
        del outs
        if not all(torch.equal(x, s) for x, s in zip(given, snapshot)):
            result.status, result.reason = "FAIL", (
                "modified its input (out-of-place call)" if case.direction == "forward" else
                "modified the case's x or incoming gradient dy, which the check and the other "
                "rows read; a backward that writes into dy must be handed a copy of it")
        elif grads and not all(torch.equal(g, before) for g, before in grads):
            result.gradient_note = GRADIENT_WRITTEN
        if result.status == "ok":
            if timing_on:
                result.median_us = timing.median_us(fn)
                if graph:
                    _time_graph(result, fn, case)
            else:
                result.timing_note = "timing needs an NVIDIA GPU"
        else:
            result.timing_note = "not timed: failed validation"
        return result
    except Exception as exc:
        status = "OOM" if _is_oom(exc) else "error"
        return Result(spec.name, spec.family, spec.kind, status, _short_error(exc))
    finally:
        del given, snapshot, grads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
