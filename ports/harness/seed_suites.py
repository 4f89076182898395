"""The seeds' Triton experiments as named case lists, for ``compare.py --suite``.

* :func:`seed000`: seed 000's "Triton vs CUDA" sweep over seq {1024, 2048, 4096, 8192}.
* :func:`seed002`: seed 002's GB/s sweep (head_num 64, head_dim 128, batch {1, 2, 4, 8},
  seq_len 256..3968 in steps of 128), thinned by default.
* seed 004 is not a list of RoPE cases (its fused kernel includes the projection matmul): it
  runs as ``compare.py --pipeline`` (:mod:`ports.harness.pipeline`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from reference.case import RopeCase

SEED000_SEQS = (1024, 2048, 4096, 8192)
SEED002_SEQS = tuple(range(256, 3969, 128))  # the seed's x_vals = [128 * i for i in range(2, 32)]
SEED002_BATCHES = (1, 2, 4, 8)


def seed000(head_dim: int = 256) -> list[RopeCase]:
    """Seed 000's ``benchmark_seqlen``: sbhd ``[s, 2, 64, 256]`` fp16, rotary_percent 1, TE's
    rotate-half convention with fp32 ``freqs``, s in {1024, 2048, 4096, 8192}.

    Shape from the seed's ``test_ours.py`` (the README does not state it): ``t = torch.rand((4096,
    2, 64, 256), fp16)``, ``hidden_size = 256``. Upstream's sweep was broken in two ways, fixed
    here: the tensor was always 4096 tokens (``size`` only entered the metric), and its "GB/s" was
    ``12 * size / ms * 1e-6``, not bytes over time (the seed's table is that number). Here each
    point has its own sequence length and GB/s is the harness's (read + write of x).
    """
    return [RopeCase(2, s, 64, head_dim, layout="sbhd", dtype="fp16",
                     label=f"te sweep s={s}") for s in SEED000_SEQS]


def seed002(points: int | Sequence[int] = 512) -> list[RopeCase]:
    """Seed 002's sweep: sbhd ``[s, b, 64, 128]`` fp32 (the README's L2 note counts 4-byte
    elements), rotate-half, rotary_percent 1, b in {1, 2, 4, 8}.

    ``points`` thins the seq_len axis: an int is the spacing in tokens between points, a multiple
    of 128 (128 gives the seed's full 30 points, 256..3968; the default 512 gives 256, 768, ...,
    3840, plus the last point 3968); a sequence gives the seq_lens themselves.
    """
    if isinstance(points, int):
        if isinstance(points, bool) or points < 128 or points % 128:
            raise ValueError(f"points must be a multiple of 128 (the seed's step), got {points!r}")
        seqs = list(range(SEED002_SEQS[0], SEED002_SEQS[-1] + 1, points))
        if seqs[-1] != SEED002_SEQS[-1]:
            seqs.append(SEED002_SEQS[-1])
    else:
        seqs = [int(s) for s in points]
        if not seqs or any(s < 1 for s in seqs):
            raise ValueError(f"points must be positive seq_lens, got {points!r}")
    return [RopeCase(b, s, 64, 128, layout="sbhd", dtype="fp32", label=f"batch-reuse sweep b={b} s={s}")
            for b in SEED002_BATCHES for s in seqs]


def seed002_full() -> list[RopeCase]:
    """Every point of seed 002's sweep (120 cases)."""
    return seed002(128)


SEED_SUITES: dict[str, Callable[[], list[RopeCase]]] = {
    "te_sweep": seed000,
    "batch_reuse_sweep": seed002,
    "batch_reuse_sweep_full": seed002_full,
}
