"""fastrope as PyTorch custom ops, so that torch.compile, CUDA graphs and tracing see one op.

* ``torch.ops.fastrope.rope``: the out-of-place rotation, returning new contiguous tensors
  ``[q_out]`` or ``[q_out, k_out]``; ``inverse=True`` rotates by -theta. Its autograd is the
  same op with ``inverse`` flipped, so it is differentiable any number of times.
* ``torch.ops.fastrope.rope_``: the in-place rotation of q (and k), declared as mutating them.
  It has no autograd formula: ``apply_rope_inplace`` calls it only when no gradient is
  recorded, else ``rope`` and ``Tensor.copy_`` (see api.py).
* ``torch.ops.fastrope.rope_out``: ``rope`` writing into given outputs ``q_out`` (and
  ``k_out``), declared as mutating them: each contiguous, with its input's shape, dtype and
  device, 16-byte aligned and apart from the inputs, as ``rope`` allocates them. Traced calls
  use it (api.py, and ``rope``'s autograd): the graph allocates the outputs (inductor, in C++)
  and calls an op that returns nothing, which costs a compiled graph less host time per call
  than an op returning a list of new tensors.

The arguments are ``apply_rope``'s with ``offsets`` split in two: ``offsets`` (a per-sequence
int tensor, or None) and ``offset`` (one int for all; 0 with positions or an offsets tensor).
The implementation is :func:`ports.fastrope.run.rotate_positional` (``run.rotate`` with every
argument positional), which validates on the host and launches; the fake implementations give
the outputs' shapes, dtypes and strides without running (shape errors surface when the real op
runs).

**Why ``torch.library.Library`` and not ``torch.library.custom_op``.** A compiled graph calls
the op through the dispatcher at every run, so the op's own host cost is paid per call.
``custom_op`` adds Python kernels at three dispatch keys (autograd, the in-place version bump,
the backend), each a Python round trip with all 16 arguments; these ops register one Python
kernel each where they can:

* the backend kernel (``CompositeExplicitAutograd``: every device, so that a CPU tensor gets
  :func:`run.rotate`'s message rather than the dispatcher's);
* for ``rope``, an autograd kernel that, for plain tensors with no gradient to record and no
  dispatch mode or functionalization in the way (a compiled graph's calls), runs the
  implementation at once instead of re-dispatching; anything else goes the standard way
  (:class:`_Rotation` below autograd, or a re-dispatch);
* for ``rope_``, C++'s in-place fallback, with the version counters of q and k bumped by the
  implementation (what ``custom_op``'s Python kernel at that key does).

``compare.py --overhead`` measures both boundaries.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ports.fastrope import replay, run

NAMESPACE = "fastrope"

_ARGUMENTS = ("Tensor? cos, Tensor? sin, Tensor? positions, Tensor? offsets, int offset, "
              "Tensor? cu_seqlens, int? max_seqlen, str style, str layout, int? rotary_dim, "
              "float base, Tensor? inv_freq, bool check_positions")
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_TAGS = (torch.Tag.pt2_compliant_tag,)
_LIB.define(f"rope(Tensor q, Tensor? k, {_ARGUMENTS}, bool inverse) -> Tensor[]", tags=_TAGS)
_LIB.define(f"rope_(Tensor(a!) q, Tensor(b!)? k, {_ARGUMENTS}) -> ()", tags=_TAGS)
_LIB.define(f"rope_out(Tensor q, Tensor? k, Tensor(a!) q_out, Tensor(b!)? k_out, "
            f"{_ARGUMENTS}, bool inverse) -> ()", tags=_TAGS)
# The Python implementations of the mutating ops, which replay.cpp's kernels call on a miss: each
# returns what replaying later calls of its input key needs (run.replay_words).
_LIB.define(f"plan_rope_(Tensor(a!) q, Tensor(b!)? k, {_ARGUMENTS}) -> (int[], Tensor?)")
_LIB.define(f"plan_rope_out(Tensor q, Tensor? k, Tensor(a!) q_out, Tensor(b!)? k_out, "
            f"{_ARGUMENTS}, bool inverse) -> (int[], Tensor?)")
for _name in ("rope_", "rope_out", "plan_rope_", "plan_rope_out"):
    _LIB.m.register_ad_inplace_or_view_fallback(_name)


def _inputs(q: Tensor, k: Tensor | None) -> list[Tensor]:
    return [q] if k is None else [q, k]


def _offsets(offsets: Tensor | None, offset: int):
    """``apply_rope``'s ``offsets`` from the op's two arguments (an offset of 0 is none, so that
    it may come with positions)."""
    return offsets if offsets is not None else (offset or None)


# ---- the implementations ------------------------------------------------------------------------
# Each calls run.rotate_positional directly: this is a compiled graph's per-call path.
def _rope(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style, layout,
          rotary_dim, base, inv_freq, check_positions, inverse):
    """q (and k) rotated by theta (``inverse``: -theta) into new contiguous tensors."""
    out = run.rotate_positional(run.DESIGN, q, k, False, inverse, check_positions, cos, sin,
                                positions, _offsets(offsets, offset), cu_seqlens, max_seqlen,
                                style, layout, rotary_dim, base, inv_freq)
    return [out] if k is None else list(out)


def _rope_(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style, layout,
           rotary_dim, base, inv_freq, check_positions):
    """q (and k) rotated by theta in place."""
    run.rotate_positional(run.DESIGN, q, k, True, False, check_positions, cos, sin, positions,
                          _offsets(offsets, offset), cu_seqlens, max_seqlen, style, layout,
                          rotary_dim, base, inv_freq)
    torch.autograd.graph.increment_version(_inputs(q, k))


def _rope_out(q, k, q_out, k_out, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen,
              style, layout, rotary_dim, base, inv_freq, check_positions, inverse):
    """q (and k) rotated by theta (``inverse``: -theta) into q_out (and k_out)."""
    outs = _inputs(q_out, k_out)
    run.rotate_positional(run.DESIGN, q, k, False, inverse, check_positions, cos, sin, positions,
                          _offsets(offsets, offset), cu_seqlens, max_seqlen, style, layout,
                          rotary_dim, base, inv_freq, outs)
    torch.autograd.graph.increment_version(outs)


def _plan_rope_(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style, layout,
                rotary_dim, base, inv_freq, check_positions):
    """``rope_``, then how to replay it (replay.cpp's miss path)."""
    _rope_(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style, layout,
           rotary_dim, base, inv_freq, check_positions)
    return run.replay_words(run.DESIGN, q, k, True, False, check_positions, cos, sin, positions,
                            _offsets(offsets, offset), cu_seqlens, max_seqlen, style, layout,
                            rotary_dim, base, inv_freq)


def _plan_rope_out(q, k, q_out, k_out, cos, sin, positions, offsets, offset, cu_seqlens,
                   max_seqlen, style, layout, rotary_dim, base, inv_freq, check_positions,
                   inverse):
    """``rope_out``, then how to replay it (replay.cpp's miss path)."""
    _rope_out(q, k, q_out, k_out, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen,
              style, layout, rotary_dim, base, inv_freq, check_positions, inverse)
    return run.replay_words(run.DESIGN, q, k, False, inverse, check_positions, cos, sin,
                            positions, _offsets(offsets, offset), cu_seqlens, max_seqlen, style,
                            layout, rotary_dim, base, inv_freq, _inputs(q_out, k_out))


_LIB.impl("rope", _rope, "CompositeExplicitAutograd")
_LIB.impl("rope_", _rope_, "CompositeExplicitAutograd")
_LIB.impl("rope_out", _rope_out, "CompositeExplicitAutograd")
_LIB.impl("plan_rope_", _plan_rope_, "CompositeExplicitAutograd")
_LIB.impl("plan_rope_out", _plan_rope_out, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{NAMESPACE}::rope", lib=_LIB)
def _rope_fake(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style, layout,
               rotary_dim, base, inv_freq, check_positions, inverse):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in _inputs(q, k)]


@torch.library.register_fake(f"{NAMESPACE}::rope_", lib=_LIB)
def _rope_inplace_fake(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style,
                       layout, rotary_dim, base, inv_freq, check_positions):
    return None


@torch.library.register_fake(f"{NAMESPACE}::rope_out", lib=_LIB)
def _rope_out_fake(q, k, q_out, k_out, cos, sin, positions, offsets, offset, cu_seqlens,
                   max_seqlen, style, layout, rotary_dim, base, inv_freq, check_positions,
                   inverse):
    return None


# ---- autograd of rope ---------------------------------------------------------------------------
_ROPE = torch.ops.fastrope.rope.default
_ROPE_OUT = torch.ops.fastrope.rope_out.default


def rotate_into(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style, layout,
                rotary_dim, base, inv_freq, check_positions, inverse) -> tuple:
    """``rope`` as traced calls make it: new outputs (:func:`run.new_outputs`), then
    ``rope_out`` into them; returns them, (q_out,) or (q_out, k_out)."""
    outs = run.new_outputs(_inputs(q, k))
    _ROPE_OUT(q, k, outs[0], outs[1] if k is not None else None, cos, sin, positions, offsets,
              offset, cu_seqlens, max_seqlen, style, layout, rotary_dim, base, inv_freq,
              check_positions, inverse)
    return tuple(outs)


def _plain(x: Tensor | None) -> bool:
    """Whether the backend kernel may run on ``x`` directly: a plain dense tensor (no subclass,
    no meta, functional or functorch wrapper)."""
    return x is None or (type(x) is Tensor and not x.is_meta
                         and not torch._is_functional_tensor(x)
                         and not torch._C._functorch.is_functorch_wrapped_tensor(x))


class _Rotation(torch.autograd.Function):
    """``rope`` recorded for autograd; the backward rotates dy back by the same op, inverted."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style,
                layout, rotary_dim, base, inv_freq, check_positions, inverse):
        ctx.save_for_backward(cos, sin, positions, offsets, cu_seqlens, inv_freq)
        ctx.scalars = (offset, max_seqlen, style, layout, rotary_dim, base)
        ctx.inverse, ctx.has_k = inverse, k is not None
        with torch._C._AutoDispatchBelowAutograd():
            return rotate_into(q, k, cos, sin, positions, offsets, offset, cu_seqlens,
                               max_seqlen, style, layout, rotary_dim, base, inv_freq,
                               check_positions, inverse)

    @staticmethod
    def backward(ctx, *grads):
        cos, sin, positions, offsets, cu_seqlens, inv_freq = ctx.saved_tensors
        offset, max_seqlen, style, layout, rotary_dim, base = ctx.scalars
        gs = run.dense_gradients(grads[:2] if ctx.has_k else grads[:1])
        dq, *dk = rotate_into(gs[0], gs[1] if ctx.has_k else None, cos, sin, positions,
                              offsets, offset, cu_seqlens, max_seqlen, style, layout,
                              rotary_dim, base, inv_freq, False, not ctx.inverse)
        return (dq, dk[0] if dk else None) + (None,) * 14


def _rope_autograd(q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style,
                   layout, rotary_dim, base, inv_freq, check_positions, inverse):
    """``rope`` at the autograd key: the implementation at once on plain tensors with no dispatch
    mode active (a compiled graph's calls, no_grad calls), else recorded or re-dispatched."""
    args = (q, k, cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style, layout,
            rotary_dim, base, inv_freq, check_positions, inverse)
    if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
        return list(_Rotation.apply(*args))
    if _plain(q) and _plain(k) and not torch._C._len_torch_dispatch_stack():
        return _rope(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return _ROPE(*args)


_LIB.impl("rope", _rope_autograd, "Autograd")


# ---- the mutating ops' C++ kernels on CUDA tensors (replay.py) --------------------------------
if torch.cuda.is_available():
    replay.load()
