"""``apply_rope`` and ``apply_rope_inplace``: the public API and its autograd.

A call is validated on the host (problem.py), planned and packed (plan.py, launcher.py), both
cached by input geometry, then launched once for q and k together. :func:`rotate` is that path;
the public functions are it with the design's tuning, ablation.py with another one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ports import _alloc
from ports.fastrope import launcher, plan, problem
from ports.fastrope.problem import Problem

if TYPE_CHECKING:
    from ports.fastrope.ablation import Tuning


@dataclass(eq=False)  # compared and hashed by identity: one per input key
class _Entry:
    """A validated problem, the tuning it runs with (None: the design) and its forward launches
    (planned by the first call, which has the real outputs)."""

    problem: Problem
    tuning: Tuning | None
    launches: list | None = None


# Entries by input key; backward launches by (entry, gradients' geometry, tables' alignment).
_ENTRIES: dict = {}
_BACKWARD: dict = {}
_CACHE_LIMIT = 1024


def _remember(cache: dict, key, value):
    """Store ``value`` under ``key`` (None: not cacheable), emptying a full cache first."""
    if key is not None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = value
    return value


def _launches(entry: _Entry, xs, outs, *, in_place: bool, backward: bool, cos, sin):
    """The launches for tensors ``xs`` (q, k) writing ``outs``: one, or one per tensor; each a
    ``(Launch, indices of xs)`` pair. Empty tensors are left out."""
    p, tuning = entry.problem, entry.tuning
    operands = []
    for x, out in zip(xs, outs):
        heads = problem.heads(x, p.layout)
        operands.append(plan.Operand(x, out, heads, problem.strides(x, p.layout),
                                     problem.strides(out, p.layout))
                        if heads and x.numel() else None)
    live = [i for i, op in enumerate(operands) if op is not None]
    separate = tuning is not None and tuning.separate_launches
    groups = [[i] for i in live] if separate else ([live] if live else [])
    options = tuning.plan_options() if tuning is not None else {}
    result = []
    for group in groups:
        ops = [operands[i] for i in group]
        chosen = plan.choose(
            operands=ops, batch=p.batch, seqlen=p.seqlen, head_dim=p.head_dim,
            rotary_dim=p.rotary_dim, interleaved=p.interleaved,
            tables=None if p.computed else (cos, sin, p.half_table),
            computed=p.computed, in_place=in_place, **options)
        lc = launcher.prepare(chosen, ops, seqlen=p.seqlen, half=p.rotary_dim // 2,
                              half_table=p.half_table, table_rows=p.table_rows,
                              table_stride=p.table_stride, pos_mode=p.pos_mode,
                              pos_strides=p.pos_strides, pos_int32=p.pos_int32, nseq=p.nseq,
                              backward=backward)
        result.append((lc, tuple(group)))
    return result


class _Call:
    """The per-call tensors and scalars of a validated problem (what the launch points at)."""

    __slots__ = ("cos", "cu_seqlens", "inv_freq", "pos_add", "positions", "sin")

    def __init__(self, p: Problem, q, *, cos, sin, positions, offsets, cu_seqlens, inv_freq):
        if p.tables_need_copy:
            cos, sin = cos.contiguous(), sin.contiguous()
        self.cos, self.sin = cos, sin
        self.inv_freq = None
        if p.computed:
            self.inv_freq = p.default_inv_freq if inv_freq is None else \
                inv_freq.to(device=q.device, dtype=torch.float64).contiguous()
        self.positions = positions if positions is not None else (
            offsets if isinstance(offsets, torch.Tensor) else None)
        self.cu_seqlens = cu_seqlens
        self.pos_add = offsets if isinstance(offsets, int) else 0


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _execute(launches, c: _Call, xs, outs) -> None:
    cos, sin, inv = _ptr(c.cos), _ptr(c.sin), _ptr(c.inv_freq)
    pos, cu = _ptr(c.positions), _ptr(c.cu_seqlens)
    for lc, group in launches:
        a = group[0]
        b = group[1] if len(group) > 1 else None
        launcher.launch(lc, xs[a].data_ptr(), 0 if b is None else xs[b].data_ptr(),
                        outs[a].data_ptr(), 0 if b is None else outs[b].data_ptr(),
                        cos, sin, inv, pos, cu, c.pos_add)


def _new_outputs(xs):
    """Contiguous outputs like xs (NaN under ``ports._alloc.poisoned()``, to prove every element
    is written)."""
    outs = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]
    if _alloc.poisoning():
        for out in outs:
            out.fill_(float("nan"))
    return outs


def _backward(ctx, grads):
    """The gradients of q and k: the same kernel rotating dy by -theta (the transpose)."""
    entry, c = ctx.entry, ctx.call
    gs = [g if g.stride(-1) == 1 else g.contiguous() for g in grads]  # broadcast dy: dense
    outs = _new_outputs(gs)
    key = (entry, tuple((g.dtype, g.shape, g.stride(), g.data_ptr() & 15) for g in gs),
           (_ptr(c.cos) | _ptr(c.sin)) & 15)
    launches = _BACKWARD.get(key)
    if launches is None:
        launches = _remember(_BACKWARD, key, _launches(entry, gs, outs, in_place=False,
                                                       backward=True, cos=c.cos, sin=c.sin))
    _execute(launches, c, gs, outs)
    return None, None, None, None, outs[0], (outs[1] if len(outs) > 1 else None)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry, call, launches, outs, q, k):
        ctx.entry, ctx.call = entry, call
        xs = [q] if k is None else [q, k]
        outs = outs or _new_outputs(xs)
        _execute(launches, call, xs, outs)
        return tuple(outs) if k is not None else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, grads)


class _RopeInplace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry, call, launches, outs, q, k):
        ctx.entry, ctx.call = entry, call
        xs = [q] if k is None else [q, k]
        _execute(launches, call, xs, xs)
        ctx.mark_dirty(*xs)
        return tuple(xs) if k is not None else q

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, grads)


def rotate(q, k=None, *, in_place: bool, tuning: Tuning | None = None, cos=None, sin=None,
           positions=None, offsets=None, cu_seqlens=None, max_seqlen=None, style="rotate_half",
           layout="bshd", rotary_dim=None, base=10000.0, inv_freq=None, check_positions=True):
    """:func:`apply_rope` (``in_place=False``) or :func:`apply_rope_inplace` (``in_place=True``)
    with the launch plan changed by ``tuning`` (an ``ablation.Tuning``; None: the design)."""
    key = problem.input_key(q=q, k=k, cos=cos, sin=sin, positions=positions, offsets=offsets,
                            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, style=style,
                            layout=layout, rotary_dim=rotary_dim, base=base, inv_freq=inv_freq,
                            extra=(tuning, in_place))
    entry = _ENTRIES.get(key) if key is not None else None
    if entry is None:
        p = problem.validate(q=q, k=k, cos=cos, sin=sin, positions=positions, offsets=offsets,
                             cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, style=style,
                             layout=layout, rotary_dim=rotary_dim, base=base, inv_freq=inv_freq)
        entry = _remember(_ENTRIES, key, _Entry(p, tuning))
    p = entry.problem
    if check_positions:
        problem.check_contents(p, cos=cos, positions=positions, offsets=offsets,
                               cu_seqlens=cu_seqlens)
    call = _Call(p, q, cos=cos, sin=sin, positions=positions, offsets=offsets,
                 cu_seqlens=cu_seqlens, inv_freq=inv_freq)
    xs = [q] if k is None else [q, k]
    outs = None
    launches = entry.launches
    if launches is None:  # first call of this geometry: plan with the real outputs
        outs = xs if in_place else _new_outputs(xs)
        launches = entry.launches = _launches(entry, xs, outs, in_place=in_place,
                                              backward=False, cos=call.cos, sin=call.sin)
    if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
        return (_RopeInplace if in_place else _Rope).apply(entry, call, launches, outs, q, k)
    if outs is None:
        outs = xs if in_place else _new_outputs(xs)
    _execute(launches, call, xs, outs)
    return outs[0] if k is None else tuple(outs)


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
        good (the kernel clamps rows, so a bad position is wrong, never out of bounds).
    """
    return rotate(q, k, in_place=False, cos=cos, sin=sin, positions=positions, offsets=offsets,
                  cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, style=style, layout=layout,
                  rotary_dim=rotary_dim, base=base, inv_freq=inv_freq,
                  check_positions=check_positions)


def apply_rope_inplace(q, k=None, *, cos=None, sin=None, positions=None, offsets=None,
                       cu_seqlens=None, max_seqlen=None, style="rotate_half", layout="bshd",
                       rotary_dim=None, base=10000.0, inv_freq=None, check_positions=True):
    """As :func:`apply_rope`, rotating q (and k) in place; returns them."""
    return rotate(q, k, in_place=True, cos=cos, sin=sin, positions=positions, offsets=offsets,
                  cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, style=style, layout=layout,
                  rotary_dim=rotary_dim, base=base, inv_freq=inv_freq,
                  check_positions=check_positions)
