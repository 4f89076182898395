"""fastrope as PyTorch custom ops, so that torch.compile, CUDA graphs and tracing see one op.

* ``torch.ops.fastrope.rope``: the out-of-place rotation, returning new contiguous tensors
  ``[q_out]`` or ``[q_out, k_out]``; ``inverse=True`` rotates by -theta. Its autograd
  (``register_autograd``) is the same op with ``inverse`` flipped, so it is differentiable any
  number of times.
* ``torch.ops.fastrope.rope_``: the in-place rotation of q (and k), declared as mutating them.
  PyTorch registers no autograd formula for a mutating op: ``apply_rope_inplace`` calls it only
  when no gradient is recorded, else ``rope`` and ``Tensor.copy_`` (see api.py).

The arguments are ``apply_rope``'s with ``offsets`` split in two: ``offsets`` (a per-sequence
int tensor, or None) and ``offset`` (one int for all; 0 with positions or an offsets tensor). The implementations are
:func:`ports.fastrope.run.rotate`, which validates on the host and launches; the fake
implementations give the outputs' shapes, dtypes and strides without running (shape errors
surface when the real op runs).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ports.fastrope import run

NAMESPACE = "fastrope"


def _offsets(offsets: Tensor | None, offset: int):
    """``apply_rope``'s ``offsets`` from the op's two arguments (an offset of 0 is none, so that
    it may come with positions)."""
    return offsets if offsets is not None else (offset or None)


def _inputs(q: Tensor, k: Tensor | None) -> list[Tensor]:
    return [q] if k is None else [q, k]


@torch.library.custom_op(f"{NAMESPACE}::rope", mutates_args=())
def rope(q: Tensor, k: Tensor | None, cos: Tensor | None, sin: Tensor | None,
         positions: Tensor | None, offsets: Tensor | None, offset: int,
         cu_seqlens: Tensor | None, max_seqlen: int | None, style: str, layout: str,
         rotary_dim: int | None, base: float, inv_freq: Tensor | None, check_positions: bool,
         inverse: bool) -> list[Tensor]:
    """q (and k) rotated by theta (``inverse``: -theta) into new contiguous tensors."""
    out = run.rotate(q, k, in_place=False, inverse=inverse, cos=cos, sin=sin,
                     positions=positions, offsets=_offsets(offsets, offset),
                     cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, style=style, layout=layout,
                     rotary_dim=rotary_dim, base=base, inv_freq=inv_freq,
                     check_positions=check_positions)
    return [out] if k is None else list(out)


@rope.register_fake
def _rope_fake(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style, layout,
               rotary_dim, base, inv_freq, check_positions, inverse):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in _inputs(q, k)]


def _setup_context(ctx, inputs, output):
    (_, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style, layout,
     rotary_dim, base, inv_freq, _, inverse) = inputs
    ctx.save_for_backward(cos, sin, positions, offsets, cu_seqlens, inv_freq)
    ctx.scalars = (offset, max_seqlen, style, layout, rotary_dim, base)
    ctx.inverse, ctx.has_k = inverse, k is not None


def _backward(ctx, grads):
    """dq (and dk): the gradients rotated back (the rotation's transpose is its inverse)."""
    cos, sin, positions, offsets, cu_seqlens, inv_freq = ctx.saved_tensors
    offset, max_seqlen, style, layout, rotary_dim, base = ctx.scalars
    gs = run.dense_gradients(grads[:2] if ctx.has_k else grads[:1])
    dq, *dk = rope(gs[0], gs[1] if ctx.has_k else None, cos, sin, positions, offsets, offset,
                   cu_seqlens, max_seqlen, style, layout, rotary_dim, base, inv_freq, False,
                   not ctx.inverse)
    return (dq, dk[0] if dk else None) + (None,) * 14


rope.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(f"{NAMESPACE}::rope_", mutates_args=("q", "k"))
def rope_(q: Tensor, k: Tensor | None, cos: Tensor | None, sin: Tensor | None,
          positions: Tensor | None, offsets: Tensor | None, offset: int,
          cu_seqlens: Tensor | None, max_seqlen: int | None, style: str, layout: str,
          rotary_dim: int | None, base: float, inv_freq: Tensor | None,
          check_positions: bool) -> None:
    """q (and k) rotated by theta in place."""
    run.rotate(q, k, in_place=True, cos=cos, sin=sin, positions=positions,
               offsets=_offsets(offsets, offset), cu_seqlens=cu_seqlens,
               max_seqlen=max_seqlen, style=style, layout=layout, rotary_dim=rotary_dim,
               base=base, inv_freq=inv_freq, check_positions=check_positions)


@rope_.register_fake
def _rope_inplace_fake(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style,
                       layout, rotary_dim, base, inv_freq, check_positions):
    return None
