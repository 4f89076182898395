"""TransformerEngine's current fused RoPE, ported as a CuPy RawKernel: ``apply_rotary_pos_emb``.

Upstream: ``NVIDIA/TransformerEngine@d0067d0da6cb:transformer_engine/common/fused_rope/fused_rope.cu``
(kernels and launchers), ``.../pytorch/csrc/extensions/apply_rope.cpp`` (host checks, output
allocation) and ``.../pytorch/attention/rope.py`` (``FusedRoPEFunc``, ``apply_rotary_pos_emb``
with ``fused=True``). Written anew from the design, not copied.

This is the generation after the one :mod:`ports.apex` stands in for (TE 1.5: ``sincosf`` per
element, rotate-half only). Design kept from the original:

* one block per token, grid ``(s, b)``; block ``(32, 4 if h < 16 else 8)``;
* ``sincosf`` of the token's ``d2`` fp32 angles once per block into shared memory, reused by every
  head; accurate libdevice ``sincosf`` (no fast math), all arithmetic in fp32, one rounding at
  the store;
* rotate-half and interleaved (``interleaved=True``: pairs ``(2i, 2i+1)``);
* ``freqs``: fp32 angles ``[max_s, 1, 1, d2]`` (rotate-half: ``cat(f, f)``; interleaved: each
  angle twice), read densely; partial rotary ``d2 <= d``, the tail copied;
* ``start_positions`` (int32 ``[b]``): each sequence's first position; thd with ``cu_seqlens``
  and context parallelism (``cp_size``, ``cp_rank``: dual-chunk order), and the token-linear thd
  grid with its launch heuristic; backward is the transposed rotation (same kernels);
* any input strides; the output is a new tensor dense in the input's format; int32 offsets.

Departures, each a host check that refuses an input the original mishandles:

* ``freqs`` must be contiguous (the original indexes it densely whatever its strides);
* ``start_positions`` must be int32 (the original reinterprets any dtype as ``int``) and
  ``start + length <= max_s`` for every sequence, and thd sequences must be ``<= max_s`` tokens
  long: the original reads ``freqs`` out of bounds, or (thd, grid ``(max_s, b)``) leaves the
  tokens past ``max_s`` unwritten. These checks read ``start_positions``/``cu_seqlens`` on the
  host (a device sync the original does not have), except during CUDA-graph capture, where the
  kernel bounds the ``freqs`` row instead (a row past the table gives NaN, not a stray read);
* ``cu_seqlens`` must be int32, rise from 0 and end at ``cp_size x t``; with ``cp_size > 1``
  every local length must be even (the original's device ``assert``);
* ``d2`` must be even and > 0; sizes past int32 offsets are refused (the original overflows);
* the fused-QKV kernels (``fused_qkv_rope_*``) are not ported.
"""
from __future__ import annotations

import torch

from ports.te._launch import fused_rope_backward, fused_rope_forward

UPSTREAM = ("NVIDIA/TransformerEngine@d0067d0da6cb:transformer_engine/common/fused_rope/"
            "fused_rope.cu (host: pytorch/csrc/extensions/apply_rope.cpp, pytorch/attention/rope.py)")


class FusedRoPEFunc(torch.autograd.Function):
    """TE's autograd Function: forward and backward through the fused kernels."""

    @staticmethod
    def forward(ctx, t, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None,
                cp_size=1, cp_rank=0, start_positions=None):
        out = fused_rope_forward(t, freqs, start_positions, tensor_format, interleaved,
                                 cu_seqlens, cp_size, cp_rank)
        ctx.save_for_backward(freqs, cu_seqlens, start_positions)
        ctx.args = (tensor_format, interleaved, cp_size, cp_rank)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        freqs, cu_seqlens, start_positions = ctx.saved_tensors
        tensor_format, interleaved, cp_size, cp_rank = ctx.args
        grad_input = fused_rope_backward(grad_output, freqs, start_positions, tensor_format,
                                         interleaved, cu_seqlens, cp_size, cp_rank)
        return grad_input, None, None, None, None, None, None, None


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         start_positions: torch.Tensor | None = None, interleaved: bool = False,
                         cu_seqlens: torch.Tensor | None = None, cp_size: int = 1,
                         cp_rank: int = 0) -> torch.Tensor:
    """TE's ``apply_rotary_pos_emb(..., fused=True)``: ``t`` in ``tensor_format`` (``sbhd``,
    ``bshd`` ``[.., h, d]``, or ``thd`` ``[t, h, d]`` with ``cu_seqlens``), fp32 ``freqs``
    ``[max_s, 1, 1, d2]``; returns a new tensor of ``t``'s shape."""
    return FusedRoPEFunc.apply(t, freqs, tensor_format, interleaved, cu_seqlens, cp_size,
                               cp_rank, start_positions)


__all__ = ["UPSTREAM", "FusedRoPEFunc", "apply_rotary_pos_emb", "fused_rope_forward",
           "fused_rope_backward"]
