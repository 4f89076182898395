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
    """A validated problem, what its calls need on the host, and its launches (planned by the
    first call, which has the real outputs).

    ``checks``: whether ``check_positions`` has anything to check (ids, offsets or cu_seqlens
    to read; an int offset or a sequence against the table's rows), so a call of a geometry that
    fits its table skips the check. ``direct``: whether the call's tensors are the kernel's as
    given (tables that need no copy; computed angles read an fp64 inv_freq, the default or
    the call's converted)."""

    problem: Problem
    checks: bool
    direct: bool
    spans: tuple[int, ...]  # given outputs: the bytes each input and output reaches
    launches: list | None = None


def _span(x) -> int:
    """The bytes from x's data pointer to the end of its last element."""
    return x.element_size() * (1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride()))) \
        if x.numel() else 0


def _entry(p: Problem, xs, out, *, offsets) -> _Entry:
    checks = p.check_syncs or not p.computed and (offsets is not None
                                                   or p.seqlen > p.table_rows)
    direct = not p.computed and not p.tables_need_copy
    spans = () if out is None else tuple(_span(t) for t in (*xs, *_outputs_like(xs, out)))
    return _Entry(p, checks, direct, spans)


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


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _call_tensors(p: Problem, q, cos, sin, inv_freq):
    """The tables (contiguous copies where their strides differ) and the fp64 frequencies a
    call's kernel reads: (cos, sin, inv_freq), None where it reads none."""
    if p.computed:
        return None, None, (p.default_inv_freq if inv_freq is None else
                            inv_freq.to(device=q.device, dtype=torch.float64).contiguous())
    if p.tables_need_copy:
        return cos.contiguous(), sin.contiguous(), None
    return cos, sin, None


def _execute(launches, xs, outs, cos: int, sin: int, inv_freq: int, position_tensor: int,
             cu_seqlens: int, offset: int) -> None:
    for lc, group in launches:
        a = group[0]
        b = group[1] if len(group) > 1 else None
        launcher.launch(lc, xs[a].data_ptr(), 0 if b is None else xs[b].data_ptr(),
                        outs[a].data_ptr(), 0 if b is None else outs[b].data_ptr(),
                        cos, sin, inv_freq, position_tensor, cu_seqlens, offset)


def new_outputs(xs):
    """Contiguous outputs like xs (NaN under ``ports._alloc.poisoned()``, to prove every element
    is written)."""
    outs = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]
    if _alloc.poisoning():
        for out in outs:
            out.fill_(float("nan"))
    return outs


def _outputs_like(xs, out) -> list:
    """``out`` checked to be outputs as :func:`new_outputs` makes them: one per input, each
    contiguous with its input's shape, dtype and device (the checks that depend on geometry,
    made once per input key)."""
    if not isinstance(out, (list, tuple)) or len(out) != len(xs):
        raise ValueError(f"out must be a list of {len(xs)} tensor(s), one per input")
    for x, o in zip(xs, out):
        if not (isinstance(o, torch.Tensor) and o.dtype == x.dtype and o.shape == x.shape
                and o.device == x.device and o.is_contiguous()):
            raise ValueError("each out tensor must be contiguous, with its input's shape, dtype "
                             f"and device ({tuple(x.shape)}, {x.dtype}, {x.device}), as "
                             "apply_rope allocates it")
    return list(out)


def _check_apart(spans, tensors) -> None:
    """Refuse outputs that overlap an input or each other (``tensors``: the inputs, then the
    outputs; ``spans``: their byte extents), which the kernel would read after writing."""
    starts = [t.data_ptr() for t in tensors]
    n_in = len(tensors) // 2
    for i in range(n_in, len(tensors)):
        a, na = starts[i], spans[i]
        for j in range(i):
            b, nb = starts[j], spans[j]
            if na and nb and a < b + nb and b < a + na:
                raise ValueError("out overlaps an input or another output; rope writes into "
                                 "memory of its own (apply_rope_inplace rotates in place)")


def _capturing(q) -> bool:
    """Whether q's device's current stream is capturing a CUDA graph."""
    return q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def rotate(q, k=None, *, in_place: bool, inverse: bool = False, check_positions=True, out=None,
           cos=None, sin=None, positions=None, offsets=None, cu_seqlens=None, max_seqlen=None,
           style="rotate_half", layout="bshd", rotary_dim=None, base=10000.0, inv_freq=None):
    """Rotate q (and k) by theta (``inverse``: by -theta, the backward), without autograd.

    The keywords after ``out`` are ``apply_rope``'s (:data:`ARGUMENT_DEFAULTS`); ``in_place``
    writes into q and k, else into new contiguous outputs, or into ``out`` ([q_out] or
    [q_out, k_out], as :func:`new_outputs` makes them: checked by :func:`_outputs_like`
    and :func:`_check_apart`).
    Returns q's output, or (q's, k's). The position check (``check_positions``) is skipped while
    the current stream is capturing a CUDA graph: it reads device memory on the host.
    """
    return rotate_positional(DESIGN, q, k, in_place, inverse, check_positions, cos, sin,
                             positions, offsets, cu_seqlens, max_seqlen, style, layout,
                             rotary_dim, base, inv_freq, out)


def rotate_planned(planner: Planner, q, k=None, *, in_place: bool, inverse: bool = False,
                   check_positions=True, **arguments):
    """:func:`rotate` planned by ``planner``."""
    unknown = set(arguments) - set(ARGUMENT_DEFAULTS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(sorted(unknown))}")
    arguments = dict(ARGUMENT_DEFAULTS, **arguments)
    return rotate_positional(planner, q, k, in_place, inverse, check_positions,
                             *(arguments[name] for name in ARGUMENT_DEFAULTS))


def rotate_positional(planner: Planner, q, k, in_place, inverse, check_positions, cos, sin,
                      positions, offsets, cu_seqlens, max_seqlen, style, layout, rotary_dim,
                      base, inv_freq, out=None):
    """:func:`rotate` planned by ``planner``, every argument positional: the per-call path of
    every eager call and every compiled graph's call (the ops call it directly), so a cached
    call computes its key, looks it up and launches, and nothing else unless it needs to."""
    if inverse and k is not None and k.numel() and k.data_ptr() == q.data_ptr():
        k = k.clone()  # one gradient for both outputs; q and k must be distinct memory
    if in_place:
        out = None
    key = problem.input_key(q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style,
                            layout, rotary_dim, base, inv_freq, (in_place, inverse), out)
    xs = (q,) if k is None else (q, k)
    entry = planner.entries.get(key)
    if entry is None:
        entry = _remember(planner.entries, key, _entry(problem.validate(
            q=q, k=k, cos=cos, sin=sin, positions=positions, offsets=offsets,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, style=style, layout=layout,
            rotary_dim=rotary_dim, base=base, inv_freq=inv_freq), xs, out, offsets=offsets))
    p = entry.problem
    if check_positions and entry.checks and not (p.check_syncs and _capturing(q)):
        problem.check_contents(p, cos=cos, positions=positions, offsets=offsets,
                               cu_seqlens=cu_seqlens)
    if not entry.direct:
        cos, sin, inv_freq = _call_tensors(p, q, cos, sin, inv_freq)
    if in_place:
        outs = xs
    elif out is None:
        outs = new_outputs(xs)
    else:
        outs = tuple(out)
        _check_apart(entry.spans, xs + outs)
    launches = entry.launches
    if launches is None:  # first call of this geometry: plan with the real outputs
        launches = entry.launches = _launches(planner, p, xs, outs, in_place=in_place,
                                              backward=inverse, cos=cos, sin=sin)
    offset = 0
    if isinstance(offsets, int):  # one offset for all, with or without ids
        offset, offsets = offsets, None
    _execute(launches, xs, outs, _ptr(cos), _ptr(sin), _ptr(inv_freq),
             _ptr(positions if positions is not None else offsets),  # ids, or offsets
             _ptr(cu_seqlens), offset)
    return outs[0] if k is None else tuple(outs)


REPLAY_FORMAT = 1  # the first of replay_words's words (replay.cpp's kFormat)


def replay_words(planner: Planner, q, k, in_place, inverse, check_positions, cos, sin, positions,
                 offsets, cu_seqlens, max_seqlen, style, layout, rotary_dim, base, inv_freq,
                 out=None) -> tuple[list[int], torch.Tensor | None]:
    """After :func:`rotate_positional` with the same arguments: how replay.cpp may make the
    launches of later calls of this input key with no Python, or ``([], None)`` where each call
    needs Python (a key that is not cacheable, a position check with something to read, tables
    copied or frequencies converted per call, an inverse rotation with k sharing q's memory).

    The words: :data:`REPLAY_FORMAT`, the device, its primary context, where the fp64
    frequencies come from (0: no frequencies, the tables as given; 1: the call's ``inv_freq``;
    2: the returned tensor, the default frequencies), the byte spans of the inputs and given
    outputs (their count first), then the launches (their count first), each as
    :func:`launcher.replay_words` writes it."""
    no = [], None
    if in_place:
        out = None
    key = problem.input_key(q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style,
                            layout, rotary_dim, base, inv_freq, (in_place, inverse), out)
    entry = None if key is None else planner.entries.get(key)
    if entry is None or entry.launches is None or (check_positions and entry.checks):
        return no
    if inverse and k is not None and k.numel() and k.data_ptr() == q.data_ptr():
        return no
    p, kept = entry.problem, None
    if entry.direct:
        frequencies = 0
    elif p.computed and inv_freq is None:
        frequencies, kept = 2, p.default_inv_freq
    elif p.computed and _call_tensors(p, q, cos, sin, inv_freq)[2] is inv_freq:
        frequencies = 1  # already fp64, contiguous, on q's device
    else:
        return no
    device = q.get_device()
    words = [REPLAY_FORMAT, device, launcher.primary_context(device), frequencies,
             len(entry.spans), *entry.spans, len(entry.launches)]
    for lc, group in entry.launches:
        words += launcher.replay_words(lc, group)
    return words, kept


# apply_rope's keywords after q and k, with their defaults (the validation's arguments).
ARGUMENT_DEFAULTS = dict(cos=None, sin=None, positions=None, offsets=None, cu_seqlens=None,
                          max_seqlen=None, style="rotate_half", layout="bshd", rotary_dim=None,
                          base=10000.0, inv_freq=None)


def dense_gradients(grads):
    """Gradients as the kernel reads them: a broadcast dy (autograd's own, stride 0) made dense."""
    return [g if g.stride(-1) == 1 else g.contiguous() for g in grads]


def _backward_kwargs(kwargs: dict) -> dict:
    """A forward call's keywords for its backward: dy rotated the other way, into new tensors,
    with the positions already checked."""
    return dict(kwargs, in_place=False, inverse=not kwargs["inverse"], check_positions=False)


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
        gs = dense_gradients(grads)
        out = ctx.fn(*gs, **_backward_kwargs(ctx.kwargs))
        return (None, None, out, None) if len(gs) == 1 else (None, None, *out)


class _RotatedInPlace(torch.autograd.Function):
    """Records that one tensor was rotated in place (by a launch already made): the rotation
    of views, whose in-place Function PyTorch lets return one tensor only."""

    @staticmethod
    def forward(ctx, fn, kwargs, x):
        ctx.fn, ctx.kwargs = fn, kwargs
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return None, None, ctx.fn(*dense_gradients([grad]), None, **_backward_kwargs(ctx.kwargs))


def _refuse_unrecordable(q, k) -> None:
    """In place with a recorded gradient, refuse before the kernel writes what PyTorch's autograd
    would refuse after it: a leaf that requires grad, and a view made by a function that returns
    several views (``split``, ``chunk``, ``unbind``) or in no-grad or inference mode."""
    for name, x in (("q", q), ("k", k)):
        if x is None or not x.requires_grad:
            continue
        if x.is_leaf:
            raise RuntimeError(f"{name} is a leaf that requires grad, which autograd cannot "
                               f"record an in-place rotation of; rotate a tensor computed from "
                               f"it (a projection's output), or use apply_rope")
        how = _view_creation(x)
        if how not in (None, "DEFAULT"):
            raise RuntimeError(
                f"{name} is a view PyTorch's autograd does not let be written in place "
                f"({how}: e.g. an output of split, chunk or unbind); slice it instead "
                f"(qkv[..., :heads, :]), or use apply_rope")


def _view_creation(x) -> str | None:
    """How autograd says view ``x`` was made (``DEFAULT``, ``MULTI_OUTPUT_NODE``,
    ``NO_GRAD_MODE``, ...), or None for a tensor that is not a view or where PyTorch does not say
    (the query is private)."""
    query = getattr(torch._C._autograd, "_get_creation_meta", None)
    if query is None or not x._is_view():
        return None
    try:
        return query(x).name
    except (RuntimeError, AttributeError):
        return None


def with_autograd(fn):
    """``fn`` (:func:`rotate`'s signature), recorded for autograd when q or k requires grad.

    In place with q and k, where either is a view (a model's ``q_proj(x).view(b, s, h, d)``):
    PyTorch's autograd lets a Function that writes into a view return only one tensor, so the
    rotation is one launch for both and its record a Function for each, whose backwards rotate
    dq and dk in a launch each."""
    def rotate_autograd(q, k=None, *, inverse: bool = False, **kwargs):
        kwargs["inverse"] = inverse
        if not (torch.is_grad_enabled() and (getattr(q, "requires_grad", False)
                                             or getattr(k, "requires_grad", False))):
            return fn(q, k, **kwargs)
        if kwargs["in_place"]:
            _refuse_unrecordable(q, k)
            if k is not None and (q._is_view() or k._is_view()):
                with torch.no_grad():
                    fn(q, k, **kwargs)
                return tuple(_RotatedInPlace.apply(fn, kwargs, x) for x in (q, k))
        return _Rotation.apply(fn, kwargs, q, k)

    return rotate_autograd


def rotate_autograd(q, k=None, *, inverse: bool = False, **kwargs):
    """:func:`rotate` (same arguments), recorded for autograd when q or k requires grad."""
    return with_autograd(rotate)(q, k, inverse=inverse, **kwargs)
