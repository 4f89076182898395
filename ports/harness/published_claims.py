"""The serving frameworks' published RoPE claims, for ``compare.py --claims``.

Each claim names its source (an upstream pull request), the shapes it was measured on as far as
the source gives them (and says which it does not give), and the registry rows it needs. A row
that is not registered, or that cannot run the claim's case, makes the verdict say so
("not reproducible here: ..."); nothing raises.

Every claim is judged from CUDA-graph replay times (median per call, ``run_case(graph=True)``,
as ``compare.py --graph`` times): the kernels' own time. Event times would also count the host's
work per call, which differs between rows for reasons the claims are not about: a port's added
host check of its indices is a device sync the original does not have (the FlashInfer and vLLM
port rows run theirs once before timing; SGLang's cache row still syncs per call), and a small
case's launch overhead is Python's. Each claim's text says so, and its measurement names the
time it shows.

Verdicts (:mod:`ports.harness.verdicts`): a speed-up ratio is compared as a gain (ratio - 1); a
bandwidth as a level, holding when the measured GB/s lies in the claimed range widened by the
same ``SLACK`` fraction of each end. The
GPUs differ (most sources do not name theirs), so a verdict says whether the claim's *shape* of
result reproduces on this GPU, not whether the source measured wrongly.

Rows assumed (named once here, so a rename is one edit): :data:`ROWS`, each a list of candidates
(the CuPy port first, then the installed library's peer row).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ports.harness.verdicts import level_verdict, ratio_verdict
from reference.case import RopeCase

# The registry rows these claims time, each as candidates in order of preference: the CuPy port
# (ports/flashinfer_port, ports/vllm*, ports/sglang), then the installed library's peer row
# (ports/peers). A claim times the first candidate that is registered.
ROWS: dict[str, tuple[str, ...]] = {
    # angles computed in the kernel, per-token position ids
    "flashinfer_computed": ("flashinfer_port.pos_ids", "flashinfer.pos_ids"),
    # fp32 cat(cos, sin) cache, per-token positions
    "flashinfer_cache": ("flashinfer_port.cos_sin_cache", "flashinfer.cos_sin_cache"),
    # vLLM's CUDA op: cat(cos, sin) cache in x's dtype, in place
    "vllm": ("vllm_port.rotary_embedding", "vllm.rotary_embedding"),
    "sglang_cache": ("sglang.cos_sin_cache_inplace",),
    # sgl-kernel's any-head-size kernel (head size 80)
    "sglang_any_head": ("sglang.rotary_embedding",),
}
NOT_REPRODUCIBLE = "not reproducible here"


def row(key: str) -> str:
    """The first registered candidate for ``key`` (the first candidate if none is: its
    measurement then says it is not registered)."""
    from ports import registry

    candidates = ROWS[key]
    names = set(registry.NAMES)
    return next((n for n in candidates if n in names), candidates[0])


def _rows_text(key: str) -> str:
    return " or ".join(ROWS[key])


TIMES = "CUDA-graph replay times"  # what every claim is judged from (said in each claim's text)


@dataclass
class Timed:
    """One row on one case: its median CUDA-graph replay time and the GB/s from it, or why there
    is none."""

    impl: str
    case: RopeCase
    graph_us: float | None
    gbps: float | None
    reason: str = ""


def _run(case: RopeCase, name: str) -> Timed:
    """``name`` validated and timed on ``case``, replayed from a CUDA graph."""
    from ports import registry
    from ports.harness import runner
    from ports.harness.metrics import gbps

    try:
        spec = registry.get(name)
    except KeyError:
        return Timed(name, case, None, None, f"row {name} is not registered")
    result = runner.run_case(case, [spec], graph=True).results[0]
    if result.graph_us is None:
        why = (result.reason or result.timing_note
               or ("no CUDA-graph time" if result.status == "ok" else result.status))
        return Timed(name, case, None, None, f"{name} on {case.describe()}: {why}")
    return Timed(name, case, result.graph_us, gbps(case.io_bytes(), result.graph_us))


# ---- the claims --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PublishedClaim:
    """One published claim: its source, its text, and how to measure it here."""

    source: str
    text: str
    measure: Callable[[], tuple[str, str]]  # -> (measured, verdict)


def _bandwidth(pairs: Sequence[tuple[RopeCase, str]], low_gbps: float, high_gbps: float
               ) -> tuple[str, str]:
    timed = [_run(case, name) for case, name in pairs]
    missing = [t.reason for t in timed if t.gbps is None]
    if missing:
        return missing[0], f"{NOT_REPRODUCIBLE}: {missing[0]}"
    text = "; ".join(f"{t.impl} {t.case.batch}x{t.case.seqlen}: {t.gbps / 1000:.2f} TB/s "
                     f"({t.graph_us:.0f} us graph)" for t in timed)
    return text, level_verdict(statistics.median(t.gbps for t in timed), low_gbps, high_gbps)


def _ratio(pairs: Sequence[tuple[RopeCase, RopeCase]], slow: str, fast: str, low: float,
           high: float | None = None) -> tuple[str, str]:
    """``slow``'s time over ``fast``'s, each on its own form of the same problem."""
    ratios, shown = [], []
    for slow_case, fast_case in pairs:
        a, b = _run(slow_case, slow), _run(fast_case, fast)
        for t in (a, b):
            if t.graph_us is None:
                return t.reason, f"{NOT_REPRODUCIBLE}: {t.reason}"
        ratios.append(a.graph_us / b.graph_us)
        shown.append(f"{fast_case.tokens} tokens: {b.graph_us:.1f} vs {a.graph_us:.1f} us")
    text = (f"{fast} {min(ratios):.2f}-{max(ratios):.2f}x faster than {slow} "
            f"(median {statistics.median(ratios):.2f}; graph times {'; '.join(shown)})")
    return text, ratio_verdict(statistics.median(ratios), low, high)


def flashinfer_pr619_cases() -> list[tuple[RopeCase, str]]:
    """FlashInfer PR 619's four points at 2.39-2.71 TB/s: 19 x 1024 and 99 x 128 tokens, 32 q
    and 8 kv heads, head dim 128, angles computed in the kernel (``use_cos_sin_cache: False``)
    and from the fp32 cos/sin cache (``True``). The thread prints neither the dtype nor the GPU:
    its GB/s figures equal 2 x 2-byte x (q + k) / latency, so the dtype is 16-bit (fp16 here);
    the earlier PR 599 ran the same script on an H100. Positions: the benchmark passes per-token
    position ids; here each sequence counts from 0 (``arange``). NeoX (rotate-half)."""
    out = []
    for batch, length in ((19, 1024), (99, 128)):
        case = RopeCase(batch, length, 32, 128, kv_heads=8, dtype="fp16",
                        label=f"FlashInfer PR 619 {batch}x{length}")
        out += [(case, row("flashinfer_computed")), (case, row("flashinfer_cache"))]
    return out


def vllm_pr21126_cases() -> list[tuple[RopeCase, RopeCase]]:
    """vLLM PR 21126 says only "microbenchmarks show ~2x speedup vs our custom op": no shapes,
    dtype or GPU. Measured here on the shape of FlashInfer's ``benchmarks/bench_rope.py`` (the
    benchmark that compares the two ops: 32 q and 8 kv heads, head dim 128, bf16, NeoX), at
    1024, 8192 and 65536 tokens of one sequence. Each op gets its own table form: vLLM's cache
    in x's dtype, FlashInfer's in fp32 (the tables differ only by rounding)."""
    out = []
    for tokens in (1024, 8192, 65536):
        base = RopeCase(1, tokens, 32, 128, kv_heads=8, dtype="bf16",
                        label=f"vLLM PR 21126 {tokens} tokens")
        out.append((base.replace(cos_sin_dtype="same"), base))
    return out


def sglang_pr6530_cases() -> list[tuple[RopeCase, RopeCase]]:
    """SGLang PR 6530's benchmark id ``[80-80-1000000.0-1000000.0-False-dtype1-cuda-1-4000-16-16]``,
    read as head size 80, rotary dim 80, max position 1e6, base 1e6, is_neox False (GPT-J,
    interleaved), dtype index 1 (the thread does not name it: both fp16 and bf16 here), batch 1,
    4000 tokens, 16 q and 16 kv heads; that reading of the id's fields is ours. The times are
    pytest-benchmark minima (host wall clock per call), GPU not stated. Here: positions 0..3999
    (the thread does not say how it drew them) and a table just long enough for them (the cache
    length does not change the work); both kernels take cos/sin in x's dtype."""
    out = []
    for dtype in ("fp16", "bf16"):
        case = RopeCase(1, 4000, 16, 80, kv_heads=16, dtype=dtype, style="interleaved",
                        base=1e6, cos_sin_dtype="same", label=f"SGLang PR 6530 {dtype}")
        out.append((case, case))
    return out


def _claims() -> tuple[PublishedClaim, ...]:
    return (
        PublishedClaim(
            "flashinfer-ai/flashinfer PR 619",
            "apply_rope reaches 2.39-2.71 TB/s with 32 q and 8 kv heads, head dim 128, at "
            "19x1024 and 99x128 tokens, angles computed and from the cos/sin cache (16-bit; GPU "
            f"not stated, H100-class); rows {_rows_text('flashinfer_computed')}; "
            f"{_rows_text('flashinfer_cache')}; judged from {TIMES} (the source's own "
            "benchmark times kernels)",
            lambda: _bandwidth(flashinfer_pr619_cases(), 2390.0, 2710.0)),
        PublishedClaim(
            "vllm-project/vllm PR 21126",
            "FlashInfer's RoPE is ~2x vLLM's own custom op in microbenchmarks (shapes, dtype and "
            "GPU not stated; measured on bench_rope.py's 32/8 heads x 128, bf16, 1k-64k tokens); "
            f"{_rows_text('flashinfer_cache')} vs {_rows_text('vllm')}; judged from {TIMES}",
            lambda: _ratio(vllm_pr21126_cases(), row("vllm"), row("flashinfer_cache"), 2.0)),
        PublishedClaim(
            "sgl-project/sglang PR 6530",
            "head size 80: SGLang's kernel 29.8 us against vLLM's 117.1 us, 3.93x (16/16 heads, "
            "4000 tokens, GPT-J style, dtype and GPU not stated; the PR was closed unmerged, its "
            "successor in sgl-kernel is measured); "
            f"{_rows_text('sglang_any_head')} vs {_rows_text('vllm')}; judged from {TIMES} "
            "(the source's are host wall-clock minima per call)",
            lambda: _ratio(sglang_pr6530_cases(), row("vllm"), row("sglang_any_head"),
                           117.1 / 29.8)),
    )


CLAIMS = _claims()


def measure(make_claim) -> list:
    """Each published claim measured, as ``make_claim(source, text, measured, verdict)`` rows;
    an experiment that raises gives its error as the measurement, not a crash."""
    rows = []
    for claim in CLAIMS:
        try:
            measured, verdict = claim.measure()
        except Exception as exc:
            measured = f"error: {type(exc).__name__}: {exc}"[:160]
            verdict = NOT_REPRODUCIBLE
        rows.append(make_claim(claim.source, claim.text, measured, verdict))
    return rows


def unmeasured(make_claim, reason: str) -> list:
    return [make_claim(c.source, c.text, reason, NOT_REPRODUCIBLE) for c in CLAIMS]
