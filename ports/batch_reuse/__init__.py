"""Seed 002's batch-reuse Triton RoPE: one program per (seq, head), looping over the batch.

Upstream: seed document 002 ("Rotary Position Embedding (RoPE) optimization in Triton", a
TransformerEngine-tested kernel; only its grid and inner loop are quoted). This is an independent
re-implementation of that design, not a copy. The seed does not name its Python entry point; it
is driven by TE's unit test, so this port mirrors TE's ``apply_rotary_pos_emb(t, freqs,
tensor_format)`` as ``apply_rotary_pos_emb_triton``.

Design kept from the seed:

* Grid ``(seq_len, head_num)``; each program loads the cos/sin row of its position once and
  reuses it for every batch entry in a ``tl.static_range(0, BATCH_NUM)`` loop, ``BATCH_NUM`` being
  a ``tl.constexpr``. **Cost: a kernel is compiled for each batch size** (the loop is unrolled),
  and the unrolled body grows with the batch. The sequence length stays dynamic (a grid axis).
* cos/sin are fp32 tables made from TE's fp32 ``freqs`` (``[s, 1, 1, d]``, two equal halves) by
  the wrapper; the kernel loads their first half. Rotate-half convention, ``y1 = x1 cos - x2 sin``,
  ``y2 = x1 sin + x2 cos``, fp32 math.
* ``sbhd`` and ``bshd`` only, and the stated limitation kept: **no partial rotary**
  (``rotary_percent < 1``, i.e. ``freqs.shape[-1] < head_dim``, raises ``NotImplementedError``).

Departures:

* Every stride is passed in ((s, b, h, d) order for either format), so strided views and
  zero-stride gradients need no copy; program ids are promoted to int64 before pointer math.
* A power-of-two channel block with a mask (any even ``head_dim``).
* A backward (``BACKWARD: tl.constexpr`` flips the sign of sin) through
  ``FusedRoPEBatchReuse``; the seed's TE test checks gradients, but its backward is not quoted.
* Host checks before launch (``TypeError`` for dtypes, ``ValueError`` for shapes/devices) and a
  device guard.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ports import _alloc, _triton
from reference.vocabulary import check_dtype, check_rank

UPSTREAM = "seed 002: batch-reuse Triton RoPE (grid (seq_len, head_num), static_range over batch)"


@triton.jit
def rope_batch_reuse_kernel(t_ptr, cos_ptr, sin_ptr, out_ptr,
                            stride_ts, stride_tb, stride_th, stride_td,
                            stride_os, stride_ob, stride_oh, stride_od,
                            stride_cs, stride_cd,
                            BATCH_NUM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                            BACKWARD: tl.constexpr):
    pid_seq = tl.program_id(axis=0).to(tl.int64)
    pid_head = tl.program_id(axis=1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF

    cs_offset = pid_seq * stride_cs + cols * stride_cd
    cos = tl.load(cos_ptr + cs_offset, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + cs_offset, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        sin = -sin

    t_base = t_ptr + pid_seq * stride_ts + pid_head * stride_th
    o_base = out_ptr + pid_seq * stride_os + pid_head * stride_oh
    for batch_idx in tl.static_range(0, BATCH_NUM):
        t_row = t_base + batch_idx * stride_tb
        x1 = tl.load(t_row + cols * stride_td, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(t_row + (cols + HALF) * stride_td, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * cos - x2 * sin
        y2 = x1 * sin + x2 * cos
        o_row = o_base + batch_idx * stride_ob
        tl.store(o_row + cols * stride_od, y1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o_row + (cols + HALF) * stride_od, y2.to(out_ptr.dtype.element_ty), mask=mask)


def cos_sin_from_freqs(freqs: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The wrapper's fp32 tables ``[seq_len, d]`` from TE's ``freqs [s, 1, 1, d]``."""
    f = freqs[:seq_len, 0, 0, :].to(torch.float32)
    return torch.cos(f), torch.sin(f)


def _check(t, cos, sin, tensor_format):
    _triton.check_te_format(tensor_format)
    check_dtype(t, "t")
    for name, c in (("cos", cos), ("sin", sin)):
        check_dtype(c, name, (torch.float32,))
        check_rank(c, name, 2, "seq_len, head_dim")
    check_rank(t, "t", 4, " ".join(tensor_format))
    device = _triton.check_device(("t", t), ("cos", cos), ("sin", sin))
    seq_len = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    d = t.shape[3]
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if cos.shape[1] != d:
        raise NotImplementedError(
            f"rotary_percent < 1 is not supported (seed 002's limitation): tables have "
            f"{cos.shape[1]} channels, head_dim is {d}")
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    if cos.shape[0] < seq_len:
        raise ValueError(f"tables have {cos.shape[0]} positions; t's sequence has {seq_len}")
    return device


def rope_forward(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 tensor_format: str = "sbhd", backward: bool = False) -> torch.Tensor:
    """Rotate ``t`` by fp32 tables ``cos``/``sin`` ``[>= s, d]`` (their first half is used)."""
    device = _check(t, cos, sin, tensor_format)
    out = _alloc.empty(t.shape, dtype=t.dtype, device=t.device)
    if tensor_format == "sbhd":
        seq_len, batch = t.shape[0], t.shape[1]
    else:
        batch, seq_len = t.shape[0], t.shape[1]
    heads, half = t.shape[2], t.shape[3] // 2
    if out.numel() == 0:
        return out
    with _triton.device_guard(device):
        rope_batch_reuse_kernel[(seq_len, heads)](
            t, cos, sin, out,
            *_triton.sbhd_strides(t, tensor_format), *_triton.sbhd_strides(out, tensor_format),
            cos.stride(0), cos.stride(1),
            BATCH_NUM=batch, HALF=half, BLOCK=triton.next_power_of_2(half), BACKWARD=backward)
    return out


class FusedRoPEBatchReuse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, tensor_format="sbhd"):
        _triton.check_te_format(tensor_format)
        check_dtype(t, "t")
        check_rank(t, "t", 4, " ".join(tensor_format))
        check_dtype(freqs, "freqs", (torch.float32,))
        check_rank(freqs, "freqs", 4, "s, 1, 1, d")
        if freqs.shape[-1] != t.shape[-1]:
            raise NotImplementedError(
                f"rotary_percent < 1 is not supported (seed 002's limitation): freqs has "
                f"{freqs.shape[-1]} channels, head_dim is {t.shape[-1]}")
        seq_len = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
        cos, sin = cos_sin_from_freqs(freqs, seq_len)
        out = rope_forward(t, cos, sin, tensor_format)
        ctx.save_for_backward(cos, sin)
        ctx.tensor_format = tensor_format
        return out

    @staticmethod
    def backward(ctx, grad_output):
        cos, sin = ctx.saved_tensors
        return rope_forward(grad_output, cos, sin, ctx.tensor_format, backward=True), None, None


def apply_rotary_pos_emb_triton(t: torch.Tensor, freqs: torch.Tensor,
                                tensor_format: str = "sbhd") -> torch.Tensor:
    """RoPE of ``t`` (sbhd or bshd) with TE's fp32 ``freqs [s, 1, 1, d]`` (full rotary only)."""
    return FusedRoPEBatchReuse.apply(t, freqs, tensor_format)


__all__ = ["apply_rotary_pos_emb_triton", "FusedRoPEBatchReuse", "rope_forward",
           "cos_sin_from_freqs", "rope_batch_reuse_kernel", "UPSTREAM"]
