"""Registry entry for seed 002's batch-reuse Triton kernel.

TE's fp32 ``freqs`` is built from the case's angles in ``prepare``; the wrapper turns it into fp32
cos/sin tables (torch's fp32 cos/sin of the fp32 angles: within an fp32 rounding of the
``angles32`` oracle). Table building stays inside the timed call, as in the original's wrapper.
"""
from __future__ import annotations

from ports._spec import FLOAT_DTYPES, ImplSpec, Prepared
from ports.te_triton.canonical import prepare_te_api
from reference.case import RopeCase, RopeInputs


def _prepare(case: RopeCase, inputs: RopeInputs) -> Prepared:
    from ports import batch_reuse

    return prepare_te_api(case, inputs, batch_reuse.apply_rotary_pos_emb_triton)


SPECS = [
    ImplSpec(name="triton.batch_reuse",
             launch='program per (s, h), loop over batch (constexpr)',
             per_thread='Triton: b x d/2 pairs per program', access='Triton-vectorized',
             math='fp32, cos/sin loaded once per (s, h)', family="batch_reuse", backend="triton",
             upstream="seed 002: batch-reuse Triton RoPE (TE-tested)",
             summary="grid (s, h), cos/sin loaded once, static_range over batch (constexpr)",
             prepare=_prepare, styles=frozenset({"rotate_half"}),
             layouts=frozenset({"sbhd", "bshd"}), dtypes=FLOAT_DTYPES,
             partial=False, positions=frozenset({"arange"}), backward=True,
             devices=frozenset({"cuda", "interpret"}), table_source="angles32"),
]
