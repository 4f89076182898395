"""One call run end to end: the implementation behind the public functions and the ops.

A call is validated on the host (problem.py), planned and packed (plan.py, launcher.py), both
cached by input geometry, then launched once for q and k together. :func:`rotate` is that path
without autograd (what the registered ops run, ops.py); :func:`rotate_autograd` adds autograd
for the direct calls (api.py's eager path). :class:`Planner` is how a call is planned;
:func:`rotate` uses the design's, :data:`DESIGN` (ablation.py makes its own and runs them with
:func:`rotate_planned` and :func:`with_autograd`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ports import _alloc
from ports.fastrope import launcher, plan, problem
from ports.fastrope.problem import Problem


@dataclass(frozen=True, eq=False)
class Planner:
    """How a call's launches are planned: ``choose`` (plan.choose's signature), q and k in one
    launch or two, ``compile`` (kernel.function_ptr's signature; None: rope.cu as built for the
    design) and the launches planned so far by input key (gradients are inputs of the inverse
    rotation, with their own key)."""

    choose: Callable
    separate_launches: bool = False
    compile: Callable | None = None
    entries: dict = field(default_factory=dict)


DESIGN = Planner(plan.choose)


@dataclass(eq=False)  # compared and hashed by identity: one per input key
class _Entry:
    """A validated problem and its launches (planned by the first call, which has the real
    outputs)."""

    problem: Problem
    launches: list | None = None


_CACHE_LIMIT = 1024


def _remember(cache: dict, key, value):
    """Store ``value`` under ``key`` (None: not cacheable), emptying a full cache first."""
    if key is not None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = value
    return value


def _launches(planner: Planner, p: Problem, xs, outs, *, in_place: bool, backward: bool, cos,
              sin):
    """The launches for tensors ``xs`` (q, k) writing ``outs``: one, or one per tensor; each a
    ``(Launch, indices of xs)`` pair. Empty tensors are left out."""
    operands = []
    for x, out in zip(xs, outs):
        heads = problem.heads(x, p.layout)
        operands.append(plan.Operand(x, out, heads, problem.strides(x, p.layout),
                                     problem.strides(out, p.layout))
                        if heads and x.numel() else None)
    live = [i for i, op in enumerate(operands) if op is not None]
    groups = [[i] for i in live] if planner.separate_launches else ([live] if live else [])
    result = []
    for group in groups:
        ops = [operands[i] for i in group]
        chosen = planner.choose(p, ops, in_place=in_place, backward=backward, cos=cos, sin=sin)
        function = (None if planner.compile is None
                    else planner.compile(ops[0].src.get_device(), chosen.kernel))
        result.append((launcher.prepare(chosen, p, ops, backward=backward, function=function),
                       tuple(group)))
    return result


class _Call:
    """The per-call tensors and scalars of a validated problem (what the launch points at)."""

    __slots__ = ("cos", "cu_seqlens", "inv_freq", "offset", "position_tensor", "sin")

    def __init__(self, p: Problem, q, *, cos, sin, positions, offsets, cu_seqlens, inv_freq):
        if p.tables_need_copy:
            cos, sin = cos.contiguous(), sin.contiguous()
        self.cos, self.sin = cos, sin
        self.inv_freq = None
        if p.computed:
            self.inv_freq = p.default_inv_freq if inv_freq is None else \
                inv_freq.to(device=q.device, dtype=torch.float64).contiguous()
        self.position_tensor = positions if positions is not None else (  # ids or offsets
            offsets if isinstance(offsets, torch.Tensor) else None)
        self.cu_seqlens = cu_seqlens
        self.offset = offsets if isinstance(offsets, int) else 0


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _execute(launches, c: _Call, xs, outs) -> None:
    cos, sin, inv = _ptr(c.cos), _ptr(c.sin), _ptr(c.inv_freq)
    pos, cu = _ptr(c.position_tensor), _ptr(c.cu_seqlens)
    for lc, group in launches:
        a = group[0]
        b = group[1] if len(group) > 1 else None
        launcher.launch(lc, xs[a].data_ptr(), 0 if b is None else xs[b].data_ptr(),
                        outs[a].data_ptr(), 0 if b is None else outs[b].data_ptr(),
                        cos, sin, inv, pos, cu, c.offset)


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


def rotate(q, k=None, *, in_place: bool, inverse: bool = False, check_positions=True,
           cos=None, sin=None, positions=None, offsets=None, cu_seqlens=None, max_seqlen=None,
           style="rotate_half", layout="bshd", rotary_dim=None, base=10000.0, inv_freq=None):
    """Rotate q (and k) by theta (``inverse``: by -theta, the backward), without autograd.

    The keywords after ``check_positions`` are ``apply_rope``'s (:data:`ARGUMENT_DEFAULTS`);
    ``in_place`` writes into q and k, else into new contiguous outputs. Returns q's output, or
    (q's, k's). The position check (``check_positions``) is skipped while the current stream is
    capturing a CUDA graph: it reads device memory on the host.

    This is the per-call path of every eager call and every compiled graph's call, so its
    parameters are spelled out (no ``**kwargs`` to merge) and it goes straight to
    :func:`_rotate`.
    """
    return _rotate(DESIGN, q, k, in_place, inverse, check_positions, cos, sin, positions,
                   offsets, cu_seqlens, max_seqlen, style, layout, rotary_dim, base, inv_freq)


def rotate_planned(planner: Planner, q, k=None, *, in_place: bool, inverse: bool = False,
                   check_positions=True, **arguments):
    """:func:`rotate` planned by ``planner``."""
    unknown = set(arguments) - set(ARGUMENT_DEFAULTS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(sorted(unknown))}")
    arguments = dict(ARGUMENT_DEFAULTS, **arguments)
    return _rotate(planner, q, k, in_place, inverse, check_positions,
                   *(arguments[name] for name in ARGUMENT_DEFAULTS))


def _rotate(planner: Planner, q, k, in_place, inverse, check_positions, cos, sin, positions,
            offsets, cu_seqlens, max_seqlen, style, layout, rotary_dim, base, inv_freq):
    if inverse and k is not None and k.numel() and k.data_ptr() == q.data_ptr():
        k = k.clone()  # one gradient for both outputs; q and k must be distinct memory
    key = problem.input_key(q=q, k=k, cos=cos, sin=sin, positions=positions, offsets=offsets,
                            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, style=style,
                            layout=layout, rotary_dim=rotary_dim, base=base, inv_freq=inv_freq,
                            extra=(in_place, inverse))
    entries = planner.entries
    entry = entries.get(key) if key is not None else None
    if entry is None:
        entry = _remember(entries, key, _Entry(problem.validate(
            q=q, k=k, cos=cos, sin=sin, positions=positions, offsets=offsets,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, style=style, layout=layout,
            rotary_dim=rotary_dim, base=base, inv_freq=inv_freq)))
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
        launches = entry.launches = _launches(
            planner, p, xs, outs, in_place=in_place, backward=inverse,
            cos=None if p.computed else call.cos, sin=None if p.computed else call.sin)
    _execute(launches, call, xs, outs)
    return outs[0] if k is None else tuple(outs)


# apply_rope's keywords after q and k, with their defaults (the validation's arguments).
ARGUMENT_DEFAULTS = dict(cos=None, sin=None, positions=None, offsets=None, cu_seqlens=None,
                          max_seqlen=None, style="rotate_half", layout="bshd", rotary_dim=None,
                          base=10000.0, inv_freq=None)


def dense_gradients(grads):
    """Gradients as the kernel reads them: a broadcast dy (autograd's own, stride 0) made dense."""
    return [g if g.stride(-1) == 1 else g.contiguous() for g in grads]


class _Rotation(torch.autograd.Function):
    """A rotation with autograd: the backward is the same kernel rotating dy by -theta."""

    @staticmethod
    def forward(ctx, fn, kwargs, q, k):
        ctx.fn, ctx.kwargs = fn, kwargs
        out = fn(q, k, **kwargs)
        if kwargs["in_place"]:
            ctx.mark_dirty(*([q] if k is None else [q, k]))
        return out

    @staticmethod
    def backward(ctx, *grads):
        kwargs = dict(ctx.kwargs, in_place=False, inverse=not ctx.kwargs["inverse"],
                      check_positions=False)
        gs = dense_gradients(grads)
        out = ctx.fn(*gs, **kwargs)
        return (None, None, out, None) if len(gs) == 1 else (None, None, *out)


def with_autograd(fn):
    """``fn`` (:func:`rotate`'s signature), recorded for autograd when q or k requires grad."""
    def rotate_autograd(q, k=None, *, inverse: bool = False, **kwargs):
        kwargs["inverse"] = inverse
        if torch.is_grad_enabled() and (getattr(q, "requires_grad", False)
                                        or getattr(k, "requires_grad", False)):
            return _Rotation.apply(fn, kwargs, q, k)
        return fn(q, k, **kwargs)

    return rotate_autograd


def rotate_autograd(q, k=None, *, inverse: bool = False, **kwargs):
    """:func:`rotate` (same arguments), recorded for autograd when q or k requires grad."""
    return with_autograd(rotate)(q, k, inverse=inverse, **kwargs)
