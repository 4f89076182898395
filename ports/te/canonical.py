"""TE's current fused RoPE port as registry entries: ``te.fused_rope`` (sbhd/bshd, start
positions) and ``te.fused_rope_thd`` (packed sequences).

Tables: fp32 angles (``freqs``), the case's ideal angles rounded to fp32 and spread to the
convention's full width (table source ``angles32``); the kernel takes their ``sincosf``.
Positions: ``arange``, and ``offset`` through ``start_positions`` (int32, made in ``prepare``);
thd restarts at 0 per sequence. q and k are two calls, as TE's API takes one tensor per call.
"""
from __future__ import annotations

import torch

from ports._adapters import forward_or_backward, per_tensor
from ports._spec import ImplSpec
from ports.te import UPSTREAM
from ports.te._launch import MAX_GRID_YZ
from reference.case import RopeCase, RopeInputs
from reference.tables import expand_half
from reference.vocabulary import INT32_MAX, KERNEL_DTYPES


def _limits(case: RopeCase) -> str | None:
    if case.batch > MAX_GRID_YZ:
        return f"b = {case.batch} exceeds the grid's y limit {MAX_GRID_YZ} (grid (s, b))"
    if not case.contiguous and 3 * case.numel > INT32_MAX:
        return "x cut from a packed qkv: offsets reach 3 * numel, past int32"
    return None


def _freqs(case: RopeCase, inputs: RopeInputs) -> torch.Tensor:
    """fp32 angles ``[L, 1, 1, R]`` in the convention's layout."""
    ang = expand_half(inputs.angles.to(torch.float32), case.style).contiguous()
    return ang.view(ang.shape[0], 1, 1, case.rot_dim)


def _prepare(case: RopeCase, inputs: RopeInputs):
    from ports import te

    kw = dict(interleaved=case.style == "interleaved")
    freqs = _freqs(case, inputs)
    if case.layout == "thd":
        kw.update(tensor_format="thd", cu_seqlens=inputs.cu_seqlens)
    else:
        kw.update(tensor_format=case.layout)
        if case.positions == "offset":
            kw.update(start_positions=inputs.offsets.to(torch.int32))
    fwd = per_tensor(lambda x: te.apply_rotary_pos_emb(x, freqs, **kw))
    return forward_or_backward(case, inputs, fwd)


def _specs() -> list[ImplSpec]:
    common = dict(
        family="te", backend="cupy", upstream=UPSTREAM,
        styles=frozenset({"rotate_half", "interleaved"}), dtypes=frozenset(KERNEL_DTYPES),
        partial=True, backward=True, index_bits=32, table_source="angles32", check=_limits,
        prepare=_prepare, access="scalar dtype loads",
        per_thread="1 element per (d, h) stride step",
        math="sincosf(fp32 angle) once per token into shared memory; fp32 math, one rounding")
    return [
        ImplSpec(name="te.fused_rope", layouts=frozenset({"sbhd", "bshd"}),
                 positions=frozenset({"arange", "offset"}),
                 summary="TE 2.x fused RoPE: sincosf once per token in shared memory; block per "
                         "token, (32, 4|8) threads",
                 launch="block per token: grid (s, b), block (32, 4 if h < 16 else 8)", **common),
        ImplSpec(name="te.fused_rope_thd", layouts=frozenset({"thd"}),
                 positions=frozenset({"arange"}),
                 summary="TE 2.x fused RoPE, packed varlen: grid (max_s, b) or one block per "
                         "token; cu_seqlens checked on host (a sync)",
                 launch="grid (max_s, b), or (t) when that wastes many blocks; block (32, 4|8)",
                 **common),
    ]


SPECS = _specs()
