"""The serving frameworks' published claims: their declarations, shapes and verdicts (CPU)."""
from __future__ import annotations

import pytest

from ports.harness import claims, published_claims as pc
from reference.case import RopeCase


def test_every_published_claim_names_its_source_and_rows():
    sources = [c.source for c in pc.CLAIMS]
    assert sources == ["flashinfer-ai/flashinfer PR 619", "vllm-project/vllm PR 21126",
                       "sgl-project/sglang PR 6530"]
    for claim in pc.CLAIMS:
        assert "not stated" in claim.text  # each says what its source left out
    for key, index in (("flashinfer_computed", 0), ("flashinfer_cache", 0),
                       ("flashinfer_cache", 1), ("vllm", 1), ("vllm", 2), ("sglang_any_head", 2)):
        assert all(name in pc.CLAIMS[index].text for name in pc.ROWS[key])


def test_a_claim_times_the_first_registered_candidate(monkeypatch):
    from ports import registry

    assert pc.row("sglang_any_head") == "sglang.rotary_embedding"
    assert pc.row("vllm") in registry.NAMES  # the port's row, or else the installed peer's
    monkeypatch.setitem(pc.ROWS, "vllm", ("no_such.port_row", "vllm.rotary_embedding"))
    assert pc.row("vllm") == "vllm.rotary_embedding"
    monkeypatch.setitem(pc.ROWS, "vllm", ("no_such.a", "no_such.b"))
    assert pc.row("vllm") == "no_such.a"  # its measurement then says it is not registered


def test_unmeasured_lists_the_published_claims_after_the_seeds():
    rows = claims.unmeasured("no GPU")
    tail = rows[-len(pc.CLAIMS):]
    assert [r.seed for r in tail] == [c.source for c in pc.CLAIMS]
    assert all(r.measured == "no GPU" and r.verdict == pc.NOT_REPRODUCIBLE for r in tail)
    assert "PR 619" in claims.table(rows, "no GPU")


def test_pr619_shapes_and_byte_count_match_the_source():
    cases = pc.flashinfer_pr619_cases()
    assert {(c.batch, c.seqlen) for c, _ in cases} == {(19, 1024), (99, 128)}
    for case, row in cases:
        assert (case.heads, case.kv_heads, case.head_dim, case.dtype) == (32, 8, 128, "fp16")
        assert row in (*pc.ROWS["flashinfer_computed"], *pc.ROWS["flashinfer_cache"])
    # The thread's "19 x 1024, cache: 147 us, 2709.333 GB/s": its GB/s is our io_bytes (q + k
    # read and written, 2-byte elements) over its latency, rounded to the microsecond.
    case = next(c for c, _ in cases if c.batch == 19)
    assert case.io_bytes() / 147e-6 / 1e9 == pytest.approx(2709.333, rel=0.01)
    case = next(c for c, _ in cases if c.batch == 99)
    assert case.io_bytes() / 109e-6 / 1e9 == pytest.approx(2391.712, rel=0.01)


def test_pr6530_and_pr21126_shapes():
    for slow, fast in pc.sglang_pr6530_cases():
        assert (fast.tokens, fast.heads, fast.kv_heads, fast.head_dim) == (4000, 16, 16, 80)
        assert fast.style == "interleaved" and fast.base == 1e6
        assert slow.cos_sin_dtype == fast.cos_sin_dtype == "same"
    for slow, fast in pc.vllm_pr21126_cases():
        assert slow.cos_sin_dtype == "same" and fast.cos_sin_dtype == "fp32"  # each op's table
        assert slow.replace(cos_sin_dtype="fp32") == fast
        assert (fast.heads, fast.kv_heads, fast.head_dim, fast.dtype) == (32, 8, 128, "bf16")


def test_level_verdict_widens_each_end():
    assert pc.level_verdict(2500.0, 2390.0, 2710.0) == "holds"
    assert pc.level_verdict(1800.0, 2390.0, 2710.0) == "holds"          # 2390 * 0.75 = 1792.5
    assert pc.level_verdict(1700.0, 2390.0, 2710.0) == "does not hold: smaller here"
    assert pc.level_verdict(3400.0, 2390.0, 2710.0) == "does not hold: larger here"
    assert pc.ratio_verdict(117.1 / 29.8, 117.1 / 29.8) == "holds"
    assert pc.ratio_verdict(1.0, 2.0) == "does not hold: smaller here"


TINY = RopeCase(1, 4, 2, 8, kv_heads=1)


def test_a_row_that_is_not_registered_becomes_the_verdict():
    measured, verdict = pc._bandwidth([(TINY, "no_such.row")], 1.0, 2.0)
    assert "row no_such.row is not registered" in measured
    assert verdict == f"{pc.NOT_REPRODUCIBLE}: row no_such.row is not registered"
    measured, verdict = pc._ratio([(TINY, TINY)], "no_such.slow", "torch.hf_rotate_half", 2.0)
    assert verdict.startswith(pc.NOT_REPRODUCIBLE) and "no_such.slow" in verdict


def test_a_row_that_cannot_time_here_says_why(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU the eager row is timed")
    measured, verdict = pc._bandwidth([(TINY, "torch.hf_rotate_half")], 1.0, 2.0)
    assert verdict.startswith(pc.NOT_REPRODUCIBLE) and "timing needs an NVIDIA GPU" in verdict


def test_an_experiment_that_raises_is_a_row_not_a_crash(monkeypatch):
    def boom():
        raise RuntimeError("kernel fault")

    broken = pc.PublishedClaim("somewhere PR 1", "a claim", boom)
    monkeypatch.setattr(pc, "CLAIMS", (broken,))
    (row,) = pc.measure(claims.Claim)
    assert row.seed == "somewhere PR 1" and "RuntimeError: kernel fault" in row.measured
    assert row.verdict == pc.NOT_REPRODUCIBLE


def _fake_runner(monkeypatch, times: dict[str, tuple[float | None, float | None]]):
    """``run_case`` answering ``(event us, graph us)`` per row, and recording its ``graph`` flag."""
    from ports import registry
    from ports.harness import runner
    from ports.harness.result import CaseReport, Result

    asked = []

    def run_case(case, specs, *, graph=False, **kw):
        asked.append(graph)
        (spec,) = specs
        event, replay = times[spec.name]
        result = Result(spec.name, spec.family, spec.kind, "ok", median_us=event, graph_us=replay)
        return CaseReport(case, [result], None, None)

    monkeypatch.setattr(runner, "run_case", run_case)
    monkeypatch.setattr(registry, "get", lambda name: _Spec(name))
    return asked


class _Spec:
    def __init__(self, name):
        self.name, self.family, self.kind = name, name.split(".")[0], "port"


def test_bandwidth_is_judged_from_graph_times(monkeypatch):
    # An event time twice the graph time (a per-call sync) must not decide the verdict.
    case = pc.flashinfer_pr619_cases()[0][0]  # 19 x 1024: 2709 GB/s at 147 us
    asked = _fake_runner(monkeypatch, {"fi.row": (294.0, 147.0)})
    measured, verdict = pc._bandwidth([(case, "fi.row")], 2390.0, 2710.0)
    assert asked == [True]
    assert verdict == "holds" and "2.71 TB/s (147 us graph)" in measured


def test_ratio_is_judged_from_graph_times(monkeypatch):
    # Made-up times of the shape seen at 1k tokens: the fast row's event time is inflated by a
    # per-call host sync (here to above the slow row's), its graph time is half the slow row's.
    case = RopeCase(1, 1024, 32, 128, kv_heads=8, dtype="bf16")
    _fake_runner(monkeypatch, {"vllm.row": (80.0, 40.0), "fi.row": (135.0, 20.0)})
    measured, verdict = pc._ratio([(case, case)], "vllm.row", "fi.row", 2.0)
    assert verdict == "holds" and "2.00-2.00x" in measured and "20.0 vs 40.0 us" in measured
    _fake_runner(monkeypatch, {"vllm.row": (40.0, 40.0), "fi.row": (20.0, 40.0)})
    assert pc._ratio([(case, case)], "vllm.row", "fi.row", 2.0)[1].startswith("does not hold")


def test_a_row_without_a_graph_time_is_not_reproducible(monkeypatch):
    _fake_runner(monkeypatch, {"fi.row": (100.0, None)})
    measured, verdict = pc._bandwidth([(TINY, "fi.row")], 1.0, 2.0)
    assert "no CUDA-graph time" in measured and verdict.startswith(pc.NOT_REPRODUCIBLE)


def test_every_claim_says_which_time_it_uses():
    assert all(pc.TIMES in claim.text for claim in pc.CLAIMS)
    assert "graph" in pc.TIMES
