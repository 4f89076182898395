"""``apply_rope`` and ``apply_rope_inplace``: the public API.

An eager call (no torch.compile trace, no dispatch mode such as FakeTensorMode) runs the
implementation directly: :func:`run.rotate`, or :func:`run.rotate_autograd` when a gradient is
recorded. Going through the dispatcher costs 1.6-1.7x the direct call's host time on the H100 and
the H200 (results/README.md, "fastrope's per-call path"). Every other call goes through the ops
registered in ops.py, which is what torch.compile, export and tracing see; their autograd is the
one registered with them. Both paths launch the same kernel with the same plan.
"""
from __future__ import annotations

import torch

from ports.fastrope import ops, run


def _direct() -> bool:
    """Whether the call can skip the dispatcher: eager, with no dispatch mode to see the op."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack())


def _records_grad(q, k) -> bool:
    return torch.is_grad_enabled() and (getattr(q, "requires_grad", False)
                                        or getattr(k, "requires_grad", False))


def _op_arguments(*, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style, layout,
                  rotary_dim, base, inv_freq, check_positions) -> tuple:
    """The public arguments after q and k, as the ops take them (``offsets`` split into a
    tensor and an int)."""
    offset = 0
    if offsets is not None and not isinstance(offsets, torch.Tensor):
        if not isinstance(offsets, int) or isinstance(offsets, bool):
            raise TypeError(f"offsets must be an int or an int tensor, got "
                            f"{type(offsets).__name__}")
        offsets, offset = None, offsets
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        raise TypeError(f"base must be a number, got {type(base).__name__}")
    return (cos, sin, positions, offsets, offset, cu_seqlens, max_seqlen, style, layout,
            rotary_dim, float(base), inv_freq, check_positions)


def _rope(q, k, in_place, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style, layout,
          rotary_dim, base, inv_freq, check_positions):
    """Both public functions: the direct path when eager, else the ops."""
    if _direct():
        rotate = run.rotate_autograd if _records_grad(q, k) else run.rotate
        return rotate(q, k, in_place=in_place, cos=cos, sin=sin, positions=positions,
                      offsets=offsets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                      style=style, layout=layout, rotary_dim=rotary_dim, base=base,
                      inv_freq=inv_freq, check_positions=check_positions)
    args = _op_arguments(cos=cos, sin=sin, positions=positions, offsets=offsets,
                         cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, style=style,
                         layout=layout, rotary_dim=rotary_dim, base=base, inv_freq=inv_freq,
                         check_positions=check_positions)
    if not in_place:
        if _records_grad(q, k):
            outs = torch.ops.fastrope.rope(q, k, *args, False)
        else:  # new outputs, then rope_out into them: the lighter call in a compiled graph
            outs = ops.rotate_into(q, k, *args, False)
        return outs[0] if k is None else (outs[0], outs[1])
    if _records_grad(q, k):  # no autograd for a mutating custom op: rope, then copy_
        outs = torch.ops.fastrope.rope(q, k, *args, False)
        q.copy_(outs[0])
        if k is not None:
            k.copy_(outs[1])
    else:
        torch.ops.fastrope.rope_(q, k, *args)
    return q if k is None else (q, k)


def apply_rope(q, k=None, *, cos=None, sin=None, positions=None, offsets=None, cu_seqlens=None,
               max_seqlen=None, style="rotate_half", layout="bshd", rotary_dim=None,
               base=10000.0, inv_freq=None, check_positions=True):
    """Rotate q (and k) by RoPE; new contiguous outputs, in one launch.

    Parameters
    ----------
    q, k
        ``[b, s, h, d]`` (bshd), ``[s, b, h, d]`` (sbhd), ``[b, h, s, d]`` (bhsd) or packed
        ``[t, h, d]`` (thd); float32/float16/bfloat16; any strides with the last dim contiguous.
        k may have a different head count (GQA/MQA).
    cos, sin
        Tables ``[L, rotary_dim]`` in the style's natural layout (rotate-half: concatenated
        halves; interleaved: each angle twice), or ``[L, rotary_dim / 2]`` (one angle per pair).
        Row = position. Omit both to compute the angles in the kernel, in fp64, from ``base``
        (or ``inv_freq [rotary_dim / 2]``, e.g. a scaled frequency set).
    positions
        Per-token ids: ``[b, s]`` or ``[s]`` (thd: ``[t]``), int32/int64.
    offsets
        Each sequence's first position (int tensor ``[b]``, thd: ``[num_seqs]``), or one int for
        all. Without positions or offsets, token i of each sequence sits at position i.
    cu_seqlens, max_seqlen
        thd only: int32 ``[num_seqs + 1]`` boundaries; ``max_seqlen`` spares a device sync when
        ``check_positions`` is off.
    style
        ``rotate_half`` (NeoX/HF, pairs ``(i, i + R/2)``) or ``interleaved`` (GPT-J,
        ``(2i, 2i+1)``).
    rotary_dim
        Rotated channels R (even, <= d); channels R..d-1 are copied unchanged.
    check_positions
        Check on the host that every position indexes a table row (and that cu_seqlens is
        well formed). Ids and offset tensors cost one device sync; pass False when they are known
        good (the kernel clamps rows, so a bad position is wrong, never out of bounds). The check
        is skipped while the current stream captures a CUDA graph (a capture allows no sync):
        check the positions before capturing, or trust them.

    Autograd (from any thread), torch.compile (``fullgraph=True``) and CUDA-graph capture
    work; traced, the call is the op ``torch.ops.fastrope.rope`` when a gradient is recorded,
    else new outputs and ``torch.ops.fastrope.rope_out`` (ops.py).
    """
    return _rope(q, k, False, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style,
                 layout, rotary_dim, base, inv_freq, check_positions)


def apply_rope_inplace(q, k=None, *, cos=None, sin=None, positions=None, offsets=None,
                       cu_seqlens=None, max_seqlen=None, style="rotate_half", layout="bshd",
                       rotary_dim=None, base=10000.0, inv_freq=None, check_positions=True):
    """As :func:`apply_rope`, rotating q (and k) in place; returns them.

    With a gradient recorded, q and k are tensors computed in the graph; views such as
    ``q_proj(x).view(b, s, h, d)`` or slices of a packed qkv work, their backward then a launch
    for dq and one for dk. What PyTorch's autograd cannot record written in place is refused
    before anything is written: a leaf that requires grad, and an output of ``split``, ``chunk``
    or ``unbind``.

    Traced, the call is the mutating op ``torch.ops.fastrope.rope_``, or, when a gradient is
    recorded, ``torch.ops.fastrope.rope`` and ``copy_`` into q and k (PyTorch has no autograd for
    a mutating custom op).
    """
    return _rope(q, k, True, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style,
                 layout, rotary_dim, base, inv_freq, check_positions)
