"""Registry entry for seed 000's TE-style Triton kernel, called with TE's ``freqs`` from the case.

``freqs`` is TE's ``[s, 1, 1, R]`` fp32 angle tensor (``cat(a, a)`` of the case's angles rounded
to fp32), built in ``prepare`` outside the timed call; the kernel computes cos/sin from it, so the
oracle is the ``angles32`` source. Positions are TE's ``freqs[:s]``: ``arange`` only.
"""
from __future__ import annotations

import torch

from ports._adapters import forward_or_backward, per_tensor
from ports._spec import FLOAT_DTYPES, ImplSpec, Prepared
from reference.case import RopeCase, RopeInputs


def te_freqs(inputs: RopeInputs) -> torch.Tensor:
    """TE's ``freqs``: fp32 ``[L, 1, 1, R]`` with equal halves."""
    a = inputs.angles.to(torch.float32)
    return torch.cat([a, a], dim=-1)[:, None, None, :].contiguous()


def prepare_te_api(case: RopeCase, inputs: RopeInputs, apply) -> Prepared:
    """The call of a TE-style ``apply(t, freqs, tensor_format)`` on each tensor of the case, with
    ``freqs`` built here, outside the timed call."""
    freqs = te_freqs(inputs)
    fwd = per_tensor(lambda x: apply(x, freqs, case.layout))
    return forward_or_backward(case, inputs, fwd)


def _prepare(case: RopeCase, inputs: RopeInputs) -> Prepared:
    from ports import te_triton

    return prepare_te_api(case, inputs, te_triton.apply_rotary_pos_emb_triton)


SPECS = [
    ImplSpec(name="triton.te_style",
             launch='program per (s, b, h) row', per_thread='Triton: d/2 pairs per program',
             access='Triton-vectorized (two half-row loads)',
             math='fp32, sin/cos of fp32 freqs in kernel', family="te_triton", backend="triton",
             upstream="seed 000: TE-style rope_triton.py (apply_rotary_pos_emb_triton)",
             summary="program per (s,b,h) row, cos/sin from fp32 freqs in-kernel, autograd",
             prepare=_prepare, styles=frozenset({"rotate_half"}),
             layouts=frozenset({"sbhd", "bshd"}), dtypes=FLOAT_DTYPES,
             partial=True, positions=frozenset({"arange"}), backward=True,
             devices=frozenset({"cuda", "interpret"}), table_source="angles32"),
]
