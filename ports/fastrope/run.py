"""One call run end to end: the implementation behind the public functions, the ops and the ablations.

A call is validated on the host (problem.py), planned and packed (plan.py, launcher.py), both
cached by input geometry, then launched once for q and k together. :func:`rotate` is that path
without autograd (what the registered ops run, ops.py); :func:`rotate_autograd` adds autograd
for the direct calls (api.py's eager path and ablation.py's tunings).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ports import _alloc
from ports.fastrope import kernel, launcher, plan, problem
from ports.fastrope.problem import Problem
from reference.vocabulary import INT32_MAX

if TYPE_CHECKING:
    from ports.fastrope.ablation import Tuning


@dataclass(eq=False)  # compared and hashed by identity: one per input key
class _Entry:
    """A validated problem, the tuning it runs with (None: the design) and its forward launches
    (planned by the first call, which has the real outputs)."""

    problem: Problem
    tuning: Tuning | None
    launches: list | None = None


# Entries by input key (gradients are inputs of the inverse rotation, with their own key).
_ENTRIES: dict = {}
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
    # The step kernel's fields are 32-bit and it has no thd search (plan.py decides the rest).
    pos_extent = (p.batch - 1) * abs(p.pos_strides[0]) + (p.seqlen - 1) * abs(p.pos_strides[1])
    step_eligible = (p.nseq == 0 and max(p.table_rows, abs(p.table_stride), pos_extent)
                     <= INT32_MAX)
    result = []
    for group in groups:
        ops = [operands[i] for i in group]
        chosen = plan.choose(
            operands=ops, batch=p.batch, seqlen=p.seqlen, head_dim=p.head_dim,
            rotary_dim=p.rotary_dim, interleaved=p.interleaved,
            tables=None if p.computed else (cos, sin, p.half_table),
            computed=p.computed, in_place=in_place, step_eligible=step_eligible,
            step_switches=kernel.step_switches(p.pos_mode, p.pos_int32, p.half_table, backward),
            **options)
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


def _capturing(q) -> bool:
    """Whether q's device's current stream is capturing a CUDA graph."""
    return q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def rotate(q, k=None, *, in_place: bool, inverse: bool = False, tuning: Tuning | None = None,
           cos=None, sin=None, positions=None, offsets=None, cu_seqlens=None, max_seqlen=None,
           style="rotate_half", layout="bshd", rotary_dim=None, base=10000.0, inv_freq=None,
           check_positions=True):
    """Rotate q (and k) by theta (``inverse``: by -theta, the backward), without autograd.

    The arguments are ``apply_rope``'s; ``in_place`` writes into q and k, else into new
    contiguous outputs; ``tuning`` (an ``ablation.Tuning``; None: the design) changes the launch
    plan. Returns q's output, or (q's, k's). The position check (``check_positions``) is skipped
    while the current stream is capturing a CUDA graph: it reads device memory on the host.
    """
    if inverse and k is not None and k.numel() and k.data_ptr() == q.data_ptr():
        k = k.clone()  # one gradient for both outputs; q and k must be distinct memory
    key = problem.input_key(q=q, k=k, cos=cos, sin=sin, positions=positions, offsets=offsets,
                            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, style=style,
                            layout=layout, rotary_dim=rotary_dim, base=base, inv_freq=inv_freq,
                            extra=(tuning, in_place, inverse))
    entry = _ENTRIES.get(key) if key is not None else None
    if entry is None:
        p = problem.validate(q=q, k=k, cos=cos, sin=sin, positions=positions, offsets=offsets,
                             cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, style=style,
                             layout=layout, rotary_dim=rotary_dim, base=base, inv_freq=inv_freq)
        entry = _remember(_ENTRIES, key, _Entry(p, tuning))
    p = entry.problem
    if check_positions and not (p.check_syncs and _capturing(q)):
        problem.check_contents(p, cos=cos, positions=positions, offsets=offsets,
                               cu_seqlens=cu_seqlens)
    call = _Call(p, q, cos=cos, sin=sin, positions=positions, offsets=offsets,
                 cu_seqlens=cu_seqlens, inv_freq=inv_freq)
    xs = [q] if k is None else [q, k]
    outs = xs if in_place else _new_outputs(xs)
    launches = entry.launches
    if launches is None:  # first call of this geometry: plan with the real outputs
        launches = entry.launches = _launches(entry, xs, outs, in_place=in_place,
                                              backward=inverse, cos=call.cos, sin=call.sin)
    _execute(launches, call, xs, outs)
    return outs[0] if k is None else tuple(outs)


def dense_gradients(grads):
    """Gradients as the kernel reads them: a broadcast dy (autograd's own, stride 0) made dense."""
    return [g if g.stride(-1) == 1 else g.contiguous() for g in grads]


class _Rotation(torch.autograd.Function):
    """:func:`rotate` with autograd: the backward is the same kernel rotating dy by -theta."""

    @staticmethod
    def forward(ctx, kwargs, q, k):
        ctx.kwargs = kwargs
        out = rotate(q, k, **kwargs)
        if kwargs["in_place"]:
            ctx.mark_dirty(*([q] if k is None else [q, k]))
        return out

    @staticmethod
    def backward(ctx, *grads):
        kwargs = dict(ctx.kwargs, in_place=False, inverse=not ctx.kwargs["inverse"],
                      check_positions=False)
        gs = dense_gradients(grads)
        out = rotate(*gs, **kwargs)
        return (None, out, None) if len(gs) == 1 else (None, *out)


def rotate_autograd(q, k=None, *, inverse: bool = False, **kwargs):
    """:func:`rotate` (same arguments), recorded for autograd when q or k requires grad."""
    kwargs["inverse"] = inverse
    if torch.is_grad_enabled() and (getattr(q, "requires_grad", False)
                                    or getattr(k, "requires_grad", False)):
        return _Rotation.apply(kwargs, q, k)
    return rotate(q, k, **kwargs)
