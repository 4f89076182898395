"""``compare.py --claims``: every quantitative claim of the seed documents, measured here.

Each row: the seed, the claim as stated (with the GPU it was made on), what this package measures
for the same experiment on the current GPU, and a verdict. Claims are speed-up ratios, compared as
gains (ratio - 1) because the GPUs differ (:mod:`ports.harness.verdicts`: the claimed range
widened by 25% of each end); a claim is *not reproducible here* when an implementation it needs
is missing or cannot run (the reason is given). The serving frameworks' published claims
(FlashInfer, vLLM, SGLang pull requests, judged from CUDA-graph replay times) follow the seeds'
rows: :mod:`ports.harness.published_claims`.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ports import registry
from ports.harness.runner import run_case
from ports.harness.verdicts import ratio_verdict
from reference.case import RopeCase

# Seeds 000 and 002 measure themselves against "TE's CUDA fused RoPE". Two generations of it are
# registered; each verdict names the one it is against.
TE_GENERATIONS = {
    "TE 1.5 generation (apex.fused_rope: sincosf per element)": "apex.fused_rope",
    "TE 2.x, current (te.fused_rope: sincosf once per token, shared memory)": "te.fused_rope",
}


@dataclass
class Claim:
    seed: str
    claim: str
    measured: str = "not measured"
    verdict: str = "not reproducible here"


def _times(cases: Sequence[RopeCase], names: Sequence[str]) -> dict[str, list[float]] | str:
    """Median us per implementation over ``cases``, or the reason one could not be timed."""
    try:
        specs = [registry.get(n) for n in names]
    except KeyError as exc:
        return f"not registered: {exc.args[0].split(';')[0]}"
    out: dict[str, list[float]] = {n: [] for n in names}
    for case in cases:
        rep = run_case(case, specs)
        for r in rep.results:
            if r.median_us is None:
                return f"{r.impl} on {case.describe()}: {r.reason or r.timing_note or r.status}"
            out[r.impl].append(r.median_us)
    return out


def _ratio_claim(seed, text, cases, slow, fast, low, high=None, what="x faster") -> Claim:
    claim = Claim(seed, text)
    times = _times(cases, [slow, fast])
    if isinstance(times, str):
        claim.measured = times
        return claim
    ratios = [a / b for a, b in zip(times[slow], times[fast])]
    claim.measured = (f"{fast} {min(ratios):.2f}-{max(ratios):.2f}{what} than {slow} "
                      f"(median {statistics.median(ratios):.2f})")
    claim.verdict = ratio_verdict(statistics.median(ratios), low, high)
    return claim


def seed000() -> list[Claim]:
    from ports.harness.seed_suites import seed000 as cases

    return [_ratio_claim(
        "000", "TE-style Triton vs TE's CUDA fused RoPE, sbhd [s, 2, 64, 256] fp16, s = 1024..8192: "
        "the seed's table gives Triton 1.48-1.51x CUDA on its metric (12*size/ms, higher is "
        f"faster; GPU not stated); against {generation}", cases(), cuda, "triton.te_style",
        1.48, 1.51) for generation, cuda in TE_GENERATIONS.items()]


def seed001() -> list[Claim]:
    from ports.harness.suites import leetcuda_table as cases

    pack = _ratio_claim("001", "rope_f32x4_pack is 15-20% faster than rope_f32 (x[M, N] fp32, "
                        "M in {4096, 8192}, N in {512, 1024}; an Ada GPU)", cases(),
                        "leetcuda.rope_f32", "leetcuda.rope_f32x4_pack", 1.15, 1.20)
    torch_vs = _ratio_claim("001", "the CUDA kernels are ~120-170x faster than the torch "
                            "reference (upstream's naive_rope; same shapes and GPU)", cases(),
                            "torch.leetcuda_naive", "leetcuda.rope_f32", 120, 170)
    return [pack, torch_vs]


def seed002() -> list[Claim]:
    from ports.harness.seed_suites import seed002 as cases

    claimed = {1: 1.04, 2: 1.24, 4: 1.36, 8: 1.44}
    out = []
    for generation, cuda in TE_GENERATIONS.items():
        for batch, gain in claimed.items():
            chosen = [c for c in cases(points=[3968]) if c.batch == batch]
            out.append(_ratio_claim(
                "002", f"batch-reuse Triton is +{round((gain - 1) * 100)}% over TE's CUDA kernel "
                f"at batch {batch} (h 64, d 128, converged at long seq; RTX 2070 Super); against "
                f"{generation}", chosen, cuda, "triton.batch_reuse", gain))
    return out


def seed004() -> list[Claim]:
    from ports.harness import pipeline

    claimed = {"rbe": (4.94, "RBE Triton kernel 4.94x faster than PyTorch (0.027 -> 0.006 ms)"),
               "rmsnorm": (2.3, "RMSNorm Triton 2.3x faster than PyTorch (0.021 -> 0.009 ms)"),
               "fused": (1.52, ("fused RMSNorm + matmul + RoPE 1.52x faster than PyTorch "
                                 "(0.097 -> 0.064 ms)"))}
    rows = pipeline.run(None, list(claimed))
    out = []
    for exp, (gain, text) in claimed.items():
        claim = Claim("004", text + " (Llama-2-7B shapes, RTX 3090)")
        mine = [r for r in rows if r.experiment == exp and r.speedup is not None
                and not r.impl.startswith("torch")]
        bad = [r for r in rows if r.experiment == exp and r.status != "ok"]
        if bad:
            claim.measured = f"{bad[0].impl}: {bad[0].status} {bad[0].note}"
        elif mine:
            best = {}
            for r in mine:  # the kernel the claim is about: the last (fully Triton) row per shape
                best[r.shape] = r
            claim.measured = "; ".join(f"{s.split(':')[0]}: {r.speedup:.2f}x ({r.impl})"
                                       for s, r in best.items())
            claim.verdict = ratio_verdict(statistics.median(r.speedup for r in best.values()), gain)
        out.append(claim)
    return out


CLAIMS: tuple[Callable[[], Claim | list[Claim]], ...] = (seed000, seed001, seed002, seed004)


def measure() -> list[Claim]:
    from ports.harness import published_claims

    rows: list[Claim] = []
    for fn in CLAIMS:
        try:
            got = fn()
        except Exception as exc:  # one experiment failing must not hide the others
            got = Claim(fn.__name__.replace("seed", ""), fn.__doc__ or fn.__name__,
                        f"error: {type(exc).__name__}: {exc}"[:160])
        rows += got if isinstance(got, list) else [got]
    return rows + published_claims.measure(Claim)


def unmeasured(reason: str) -> list[Claim]:
    """The claims with the reason they were not measured (e.g. no GPU)."""
    generations = [g.split(" (")[0] for g in TE_GENERATIONS]
    texts = [
        *[("000", "TE-style Triton vs TE's CUDA fused RoPE over seq 1024-8192: Triton "
                  f"1.48-1.51x; against {g}") for g in generations],
        ("001", "rope_f32x4_pack 15-20% faster than rope_f32 (Ada GPU)"),
        ("001", "CUDA kernels 120-170x faster than torch (upstream's naive_rope)"),
        *[("002", f"batch-reuse Triton +{gain}% over CUDA at batch {b} (RTX 2070 Super); "
                  f"against {g}")
          for g in generations for b, gain in ((1, 4), (2, 24), (4, 36), (8, 44))],
        ("004", "RBE 4.94x faster than PyTorch (RTX 3090)"),
        ("004", "RMSNorm 2.3x faster than PyTorch (RTX 3090)"),
        ("004", "fused RMSNorm + matmul + RoPE 1.52x faster than PyTorch (RTX 3090)"),
    ]
    from ports.harness import published_claims

    return ([Claim(seed, text, reason) for seed, text in texts]
            + published_claims.unmeasured(Claim, reason))


def table(claims: Sequence[Claim], gpu: str, fmt: str = "github") -> str:
    from ports.harness.report import text_table

    rows = [[c.seed, c.claim, c.measured, c.verdict] for c in claims]
    return text_table(rows, ["seed", "claim (as stated)", f"measured on {gpu}", "verdict"], fmt,
                      fit=True)
