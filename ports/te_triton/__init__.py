"""Seed 000's TE-style Triton RoPE: ``apply_rotary_pos_emb_triton`` and ``FusedRoPETriton``.

Upstream: seed document 000 (Korean README of a ``rope_triton.py`` written against
NVIDIA TransformerEngine's ``apply_rotary_pos_emb(t, freqs, tensor_format)``; its kernels
``rope_kernel_forward`` / ``rope_kernel_backward`` are quoted in the seed). This is an independent
re-implementation of that design, not a copy.

Design kept from the seed:

* API: ``apply_rotary_pos_emb_triton(t, freqs, tensor_format="sbhd")`` with TE's ``freqs``: fp32
  angles ``[s_max, 1, 1, d2]`` whose two halves are equal (``cat(a, a)``), rotate-half convention,
  ``FusedRoPETriton`` autograd Function (forward -> wrapper -> kernel; backward the same).
* One program per ``(s, b, h)`` row; it rotates the first ``d2`` channels of that row.
* Only the first half of the ``freqs`` row is loaded; cos/sin are computed in the kernel in fp32
  (table source ``angles32``: exact cos/sin of the fp32 angles).
* Backward is the transposed rotation (the sign of sin flips): one kernel with a
  ``BACKWARD: tl.constexpr`` flag instead of two copies of it.
* ``rotary_percent < 1`` (``d2 < d``): the tail ``t[..., d2:]`` passes through in the wrapper.
* ``seq_len``, ``b``, ``h`` are runtime ints (a new sequence length does not recompile).

Departures (each a safety or generality addition; the math is unchanged):

* Every stride is passed in, in (s, b, h, d) order for either format: ``bshd`` and strided views
  (a q cut out of a packed qkv, a zero-stride broadcast gradient) run without a copy. The seed's
  kernel indexed ``pid * d`` into a contiguous sbhd tensor.
* Program ids are promoted to int64 before pointer arithmetic: an int32 ``pid * stride`` wraps
  once a tensor passes 2^31 elements.
* The channel block is ``next_power_of_2(d2 / 2)`` with a mask ``< d2 / 2`` (``tl.arange`` needs a
  power of two; the seed's mask ``offset < n_elements`` did not stop a row spilling into the next).
* Host checks before launch: dtypes (``TypeError``), ranks/shapes/devices (``ValueError``); a
  device guard launches on the tensors' GPU. fp32 math is explicit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ports import _alloc, _triton
from reference.vocabulary import check_dtype, check_rank

UPSTREAM = "seed 000 (TE-style rope_triton.py: rope_kernel_forward/backward, FusedRoPETriton)"


@triton.jit
def rope_kernel(t_ptr, freqs_ptr, out_ptr,
                b, h,
                stride_ts, stride_tb, stride_th, stride_td,
                stride_os, stride_ob, stride_oh, stride_od,
                stride_fs, stride_fd,
                HALF: tl.constexpr, BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
    """Rotate channels [0, 2*HALF) of one (s, b, h) row: y = R x (or R^T x when BACKWARD)."""
    pid = tl.program_id(axis=0).to(tl.int64)
    bh = b * h
    s_id = pid // bh
    rem = pid - s_id * bh
    b_id = rem // h
    h_id = rem - b_id * h

    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    # Only the first half of the freqs row: its second half repeats it.
    theta = tl.load(freqs_ptr + s_id * stride_fs + cols * stride_fd, mask=mask, other=0.0)
    theta = theta.to(tl.float32)
    cos = tl.cos(theta)
    sin = tl.sin(theta)
    if BACKWARD:
        sin = -sin

    t_row = t_ptr + s_id * stride_ts + b_id * stride_tb + h_id * stride_th
    x0 = tl.load(t_row + cols * stride_td, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(t_row + (cols + HALF) * stride_td, mask=mask, other=0.0).to(tl.float32)
    y0 = x0 * cos - x1 * sin
    y1 = x1 * cos + x0 * sin
    o_row = out_ptr + s_id * stride_os + b_id * stride_ob + h_id * stride_oh
    tl.store(o_row + cols * stride_od, y0.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + (cols + HALF) * stride_od, y1.to(out_ptr.dtype.element_ty), mask=mask)


def _check(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str) -> tuple[int, torch.device]:
    _triton.check_te_format(tensor_format)
    check_dtype(t, "t")
    check_dtype(freqs, "freqs", (torch.float32,))
    check_rank(t, "t", 4, " ".join(tensor_format))
    check_rank(freqs, "freqs", 4, "s, 1, 1, d2")
    device = _triton.check_device(("t", t), ("freqs", freqs))
    seq_len = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    d, d2 = t.shape[3], freqs.shape[3]
    if freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"freqs must be [s, 1, 1, d2], got {tuple(freqs.shape)}")
    if freqs.shape[0] < seq_len:
        raise ValueError(f"freqs has {freqs.shape[0]} positions; t's sequence has {seq_len}")
    if d2 % 2 or not 0 < d2 <= d:
        raise ValueError(f"freqs' last dim d2={d2} must be even and in (0, head_dim={d}]")
    return d2, device


def _launch(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str, backward: bool
            ) -> torch.Tensor:
    d2, device = _check(t, freqs, tensor_format)
    out = _alloc.empty(t.shape, dtype=t.dtype, device=t.device)
    if d2 < t.shape[3]:  # rotary_percent < 1: the tail passes through (TE's torch.cat)
        out[..., d2:].copy_(t[..., d2:])
    seq_len, b = (t.shape[0], t.shape[1]) if tensor_format == "sbhd" else (t.shape[1], t.shape[0])
    h = t.shape[2]
    rows = seq_len * b * h
    if rows == 0:
        return out
    half = d2 // 2
    with _triton.device_guard(device):
        rope_kernel[(rows,)](
            t, freqs, out, b, h,
            *_triton.sbhd_strides(t, tensor_format), *_triton.sbhd_strides(out, tensor_format),
            freqs.stride(0), freqs.stride(3),
            HALF=half, BLOCK=triton.next_power_of_2(half), BACKWARD=backward)
    return out


def rope_wrapper_forward(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd"
                         ) -> torch.Tensor:
    """Forward rotation of ``t`` by ``freqs`` (out of place)."""
    return _launch(t, freqs, tensor_format, backward=False)


def rope_wrapper_backward(grad_output: torch.Tensor, freqs: torch.Tensor,
                          tensor_format: str = "sbhd") -> torch.Tensor:
    """Input gradient: the transposed rotation of ``grad_output`` (any strides, zero included)."""
    return _launch(grad_output, freqs, tensor_format, backward=True)


class FusedRoPETriton(torch.autograd.Function):
    """TE's ``FusedRoPEFunc`` shape: forward and backward through the Triton kernel."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd"):
        out = rope_wrapper_forward(t, freqs, tensor_format)
        ctx.save_for_backward(freqs)
        ctx.tensor_format = tensor_format
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (freqs,) = ctx.saved_tensors
        return rope_wrapper_backward(grad_output, freqs, ctx.tensor_format), None, None


def apply_rotary_pos_emb_triton(t: torch.Tensor, freqs: torch.Tensor,
                                tensor_format: str = "sbhd") -> torch.Tensor:
    """RoPE of ``t`` (``[s, b, h, d]`` or ``[b, s, h, d]``) with TE's fp32 ``freqs [s, 1, 1, d2]``.

    Channels ``d2..d-1`` pass through unchanged. Differentiable.
    """
    return FusedRoPETriton.apply(t, freqs, tensor_format)


__all__ = ["apply_rotary_pos_emb_triton", "FusedRoPETriton", "rope_wrapper_forward",
           "rope_wrapper_backward", "rope_kernel", "UPSTREAM"]
