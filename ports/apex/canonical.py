"""apex's fused RoPE as registry entries: what each variant supports, and the call from a
canonical case.

apex has no positions (the angle row is the token's ``s`` index; thd: its index inside its own
sequence), so only ``positions='arange'`` cases run, and only rotate-half.

Layouts. apex's sbhd functions take any strides and write either sbhd memory or, with
``transpose_output_memory=True``, bshd memory. So an ``sbhd`` case is passed as is (flag off) and
a ``bshd`` case as its ``[s, b, h, d]`` view ``x.transpose(0, 1)`` with the flag on; the result's
``.transpose(0, 1)`` is then a contiguous ``[b, s, h, d]`` tensor. Every output therefore has the
case's shape *and* its natural memory layout. ``bhsd`` is refused: apex cannot write that memory
layout. (Both flag values on both layouts are exercised in tests/test_gpu_apex.py.)

Tables. ``apex.fused_rope`` and ``apex.fused_rope_thd`` take fp32 angles: the case's ideal angles
rounded to fp32 and spread to full width for rotate-half (``cat(f, f)``), table source
``angles32``; the kernel takes their sine and cosine. ``apex.fused_rope_cached`` takes the case's
cos/sin tables (fp32 or x's dtype, as the original accepts; fp64 is refused), source ``tables``.

2-D. ``fused_apply_rotary_pos_emb_2d`` rotates channels ``[0, d/2)`` by a row table and
``[d/2, d)`` by a column table. A canonical bshd case with ``rotary_dim = head_dim / 2`` is exactly
that with ``img_h = s``, ``img_w = 1``, the case's cos/sin as the row table and an identity column
table (cos 1, sin 0: ``x*1 + r*0`` returns ``x`` bit for bit), so compare.py validates and times
the 2-D kernel on such cases; other cases are refused. Its own semantics (``img_h != img_w``,
tables with spare rows) are tested directly in tests/test_gpu_apex.py.
"""
from __future__ import annotations

import torch

from ports._adapters import forward_or_backward, per_tensor
from ports._spec import ImplSpec
from ports.apex._launch import MAX_GRID_YZ
from reference.case import RopeCase, RopeInputs
from reference.tables import expand_half
from reference.tolerances import DEFAULT_STEPS
from reference.vocabulary import INT32_MAX, KERNEL_DTYPES

UPSTREAM = ("NVIDIA/apex@6424da3b:csrc/megatron/fused_rotary_positional_embedding.h "
            "(wrappers: fused_rope.py@3c98f93d)")

# fp16 / bf16: apex rounds after every operation in the storage dtype (c10 Half / BFloat16):
# cos and sin rounded to the dtype (each an error up to 0.5 step of |x| resp. |partner|), both
# products rounded (0.5 step each), the sum rounded (0.5 step): up to ~2.5 steps at the data's
# magnitude when they line up, against ~0.5 for fp32-math kernels. 4 leaves margin for elements
# whose |x| exceeds the largest output. fp32 keeps the default (libdevice sincosf is within 2 ulp;
# the fused multiply-add rounds once).
APEX_STEPS = dict(DEFAULT_STEPS, fp16=4.0, bf16=4.0)

# The original's dtype dispatch: fp32 or x's own dtype for cos/sin ("same" is x's dtype).
CACHED_TABLE_DTYPES = frozenset({"fp32", "same"})


def _limits(case: RopeCase) -> str | None:
    """The original's grid and int32 limits that the generic spec fields do not cover."""
    if case.batch > MAX_GRID_YZ:
        grid = "(max_s, b)" if case.layout == "thd" else "(s, b)"
        return f"b = {case.batch} exceeds the grid's y limit {MAX_GRID_YZ} (grid {grid})"
    if not case.contiguous and 3 * case.numel > INT32_MAX:
        return "x cut from a packed qkv: offsets reach 3 * numel, past int32"
    return None


def _check_2d(case: RopeCase) -> str | None:
    if case.rot_dim * 2 != case.head_dim or case.head_dim % 4:
        return ("2-D RoPE rotates d/2 channels by row and d/2 by column: runs as a canonical "
                "case only with rotary_dim = head_dim / 2 (head_dim % 4 == 0)")
    if case.batch > MAX_GRID_YZ:
        return f"b = {case.batch} exceeds the grid's z limit {MAX_GRID_YZ} (grid (ih, iw, b))"
    return _limits(case)


# ---- tables --------------------------------------------------------------------------------------
def _freqs(case: RopeCase, inputs: RopeInputs) -> torch.Tensor:
    """fp32 angles ``[s, 1, 1, R]`` in the rotate-half layout (Megatron's ``cat(f, f)``)."""
    ang = expand_half(inputs.angles[: case.seqlen].to(torch.float32), "rotate_half")
    return ang.contiguous().view(case.seqlen, 1, 1, case.rot_dim)


def _cached_tables(case: RopeCase, inputs: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    s, r = case.seqlen, case.rot_dim
    return (inputs.cos[:s].contiguous().view(s, 1, 1, r),
            inputs.sin[:s].contiguous().view(s, 1, 1, r))


# ---- layouts -------------------------------------------------------------------------------------
def _sbhd(case: RopeCase, call):
    """``call(x_sbhd_view, transpose_output_memory)`` applied to each tensor of the case."""
    if case.layout == "sbhd":
        return per_tensor(lambda x: call(x, False))
    # bshd: the [s, b, h, d] view of x, output written in [b, s, h, d] memory, handed back as bshd.
    return per_tensor(lambda x: call(x.transpose(0, 1), True).transpose(0, 1))


# ---- prepare -------------------------------------------------------------------------------------
def _prepare_freqs(case: RopeCase, inputs: RopeInputs):
    from ports import apex

    freqs = _freqs(case, inputs)
    fwd = _sbhd(case, lambda x, flag: apex.fused_apply_rotary_pos_emb(x, freqs, flag))
    return forward_or_backward(case, inputs, fwd)


def _prepare_cached(case: RopeCase, inputs: RopeInputs):
    from ports import apex

    cos, sin = _cached_tables(case, inputs)
    fwd = _sbhd(case, lambda x, flag: apex.fused_apply_rotary_pos_emb_cached(x, cos, sin, flag))
    return forward_or_backward(case, inputs, fwd)


def _prepare_thd(case: RopeCase, inputs: RopeInputs):
    from ports import apex

    freqs = _freqs(case, inputs)  # max_s = case.seqlen rows; every sequence is <= seqlen long
    cu = inputs.cu_seqlens
    fwd = per_tensor(lambda x: apex.fused_apply_rotary_pos_emb_thd(x, cu, freqs))
    return forward_or_backward(case, inputs, fwd)


def _prepare_2d(case: RopeCase, inputs: RopeInputs):
    from ports import apex

    rows, r = inputs.cos.shape
    cos_h = inputs.cos.contiguous().view(1, rows, 1, r)  # every table row: H >= img_h = s
    sin_h = inputs.sin.contiguous().view(1, rows, 1, r)
    cos_w = torch.ones((1, 1, 1, r), dtype=inputs.cos.dtype, device=inputs.cos.device)
    sin_w = torch.zeros_like(cos_w)
    fwd = per_tensor(lambda x: apex.fused_apply_rotary_pos_emb_2d(
        x, case.seqlen, 1, cos_h, sin_h, cos_w, sin_w))
    return forward_or_backward(case, inputs, fwd)


def _specs() -> list[ImplSpec]:
    common = dict(
        family="apex", backend="cupy", upstream=UPSTREAM, styles=frozenset({"rotate_half"}),
        dtypes=frozenset(KERNEL_DTYPES), positions=frozenset({"arange"}),
        backward=True, index_bits=32, tolerance_steps=APEX_STEPS,
        launch="block per token: grid (s, b), block (32, 4 if h < 16 else 8)",
        per_thread="1 element per (d, h) stride step", access="scalar dtype loads",
    )
    rounded = "x's dtype, rounded after every op (c10 Half/BFloat16); fp32 for fp32"
    sbhd_bshd = frozenset({"sbhd", "bshd"})
    return [
        ImplSpec(name="apex.fused_rope",
                 summary="fp32 angles, sincosf per element; block per token, (32, 4|8) threads",
                 prepare=_prepare_freqs, layouts=sbhd_bshd, partial=True,
                 table_source="angles32", check=_limits,
                 math="sincosf(fp32 angle) per element; " + rounded, **common),
        ImplSpec(name="apex.fused_rope_cached",
                 summary="given cos/sin (fp32 or x's dtype); block per token",
                 prepare=_prepare_cached, layouts=sbhd_bshd, partial=True,
                 table_source="tables", table_dtypes=CACHED_TABLE_DTYPES,
                 asymmetric_tables=True, check=_limits, math="given table; " + rounded,
                 **common),
        ImplSpec(name="apex.fused_rope_thd",
                 summary="packed varlen, grid (max_s, b); cu_seqlens checked on host (a sync)",
                 prepare=_prepare_thd, layouts=frozenset({"thd"}), partial=True,
                 table_source="angles32", check=_limits,
                 math="sincosf(fp32 angle) per element; " + rounded, **common),
        ImplSpec(name="apex.fused_rope_2d",
                 summary="2-D image RoPE as img_h = s, img_w = 1 (R = d/2, width half identity)",
                 prepare=_prepare_2d, layouts=frozenset({"bshd"}), partial=True,
                 table_source="tables", table_dtypes=CACHED_TABLE_DTYPES,
                 asymmetric_tables=True, check=_check_2d, math="given tables; " + rounded,
                 **common),
    ]


SPECS = _specs()
