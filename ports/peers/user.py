"""A user's own RoPE function as a row of the study: ``compare.py --impl module:function``, or an
entry point in the group ``rope_ports.impls`` that the user's package declares.

The function takes the canonical inputs and returns the rotated tensors::

    def my_rope(q, k, cos, sin, positions, *, style, layout, rotary_dim):
        ...
        return q_out, k_out          # or q_out alone when k is None

* ``q``: the case's tensor in ``layout`` (``bshd`` ``[b, s, h, d]``, ``sbhd``, ``bhsd`` or
  ``thd`` ``[t, h, d]``); ``k``: the second tensor (``kv_heads`` heads) or ``None``.
* ``cos``, ``sin``: full-width tables ``[L, R]`` in the style's natural layout (rotate-half:
  ``cat(c, c)``; interleaved: each value twice), in the case's cos/sin dtype; row ``p`` is
  position ``p``.
* ``positions``: int64 per-token positions ``[b, s]`` (``[t]`` for thd).
* ``style``: ``"rotate_half"`` (pairs ``(i, i + R/2)``) or ``"interleaved"`` (``(2i, 2i+1)``);
  ``rotary_dim``: R, the rotated leading channels; the rest must pass through unchanged.

It must not modify its inputs (rotate copies if the kernel works in place). For the backward
direction it is differentiated by autograd, and its backward must not write into the incoming
gradient dy either (autograd may hand that tensor to another node too): the row fails if it does.

A package adds its functions without ``--impl`` by declaring entry points, in its
``pyproject.toml``::

    [project.entry-points."rope_ports.impls"]
    my_rope = "my_package.rope:my_rope"

What it supports is declared with :func:`rope_impl` (or the same dict as the attribute
``rope_supports``); undeclared cases are refused with the reason, not run. Keys and defaults:
``styles`` (both), ``layouts`` (``bshd``), ``dtypes`` (fp32, fp16, bf16), ``positions`` (all),
``partial`` (True), ``backward`` (False), ``kv_heads`` (True: q with a k), ``devices``
(``cuda``; add ``cpu`` for a function that runs on CPU tensors), ``backend`` (``torch``),
``name`` (the function's name), ``summary`` (the docstring's first line). With ``prepare=True``
the function is instead a ``prepare(case, inputs)`` that returns a zero-argument callable, the
form every registered spec has (:mod:`ports._spec`).
"""
from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterable

import torch

from ports import _impl_target
from ports._adapters import forward_or_backward
from ports.peers import PeerSpec
from reference.case import RopeCase, RopeInputs
from reference.vocabulary import DTYPES, LAYOUTS, POSITION_KINDS, STYLES

ENTRY_POINT_GROUP = "rope_ports.impls"
FAMILY = "user"
SUPPORT_KEYS = ("styles", "layouts", "dtypes", "positions", "partial", "backward", "kv_heads",
                "devices", "backend", "name", "summary", "prepare")
DEVICES = ("cuda", "cpu", "interpret")
BACKENDS = ("torch", "triton", "cupy")


class BadImpl(ValueError):
    """A ``--impl`` or entry point that does not name a usable function; one line says why."""


def rope_impl(**supports):
    """Declare what a user function supports (keys: see the module docstring)::

        @rope_impl(styles=["rotate_half"], layouts=["bshd", "thd"], devices=["cuda", "cpu"])
        def my_rope(q, k, cos, sin, positions, *, style, layout, rotary_dim): ...
    """
    unknown = sorted(set(supports) - set(SUPPORT_KEYS))
    if unknown:
        raise TypeError(f"rope_impl: unknown keys {unknown}; expected some of {SUPPORT_KEYS}")

    def mark(fn):
        fn.rope_supports = dict(supports)
        return fn
    return mark


def _choices(supports: dict, key: str, allowed: Iterable[str], default: Iterable[str],
             where: str) -> frozenset[str]:
    value = supports.get(key, default)
    values = frozenset([value] if isinstance(value, str) else value)
    bad = sorted(values - set(allowed))
    if bad or not values:
        raise BadImpl(f"{where}: {key} {sorted(values)} must be a non-empty subset of "
                      f"{list(allowed)}")
    return values


def _call_canonical(fn: Callable) -> Callable[[RopeCase, RopeInputs], Callable]:
    """The ``prepare`` for a function of the canonical signature."""
    def prepare(case: RopeCase, inputs: RopeInputs):
        kw = dict(style=case.style, layout=case.layout, rotary_dim=case.rot_dim)

        def forward(xs):
            k = xs[1] if len(xs) > 1 else None
            out = fn(xs[0], k, inputs.cos, inputs.sin, inputs.positions, **kw)
            outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
            return tuple(o for o in outs if o is not None)
        return forward_or_backward(case, inputs, forward)
    return prepare


def spec_from_callable(fn: Callable, where: str) -> PeerSpec:
    """The registry entry for ``fn`` (``where`` names it in messages: ``mod:fn`` or the entry
    point)."""
    if not callable(fn):
        raise BadImpl(f"{where} is a {type(fn).__name__}, not a callable")
    supports = dict(getattr(fn, "rope_supports", {}) or {})
    unknown = sorted(set(supports) - set(SUPPORT_KEYS))
    if unknown:
        raise BadImpl(f"{where}: rope_supports has unknown keys {unknown}; expected some of "
                      f"{list(SUPPORT_KEYS)}")
    backend = supports.get("backend", "torch")
    if backend not in BACKENDS:
        raise BadImpl(f"{where}: backend {backend!r} must be one of {list(BACKENDS)}")
    name = supports.get("name") or getattr(fn, "__name__", "impl")
    doc = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    with_k = bool(supports.get("kv_heads", True))

    def check(case: RopeCase) -> str | None:
        if case.with_v:
            return "user functions take q and k (no v)"
        if case.kv_heads is not None and not with_k:
            return "declared without k (kv_heads=False)"
        return None

    prepare = fn if supports.get("prepare") else _call_canonical(fn)
    return PeerSpec(
        name=f"{FAMILY}.{name}", family=FAMILY, backend=backend, kind="peer",
        upstream=where, summary=supports.get("summary") or (doc[0] if doc else where),
        prepare=prepare,
        styles=_choices(supports, "styles", STYLES, STYLES, where),
        layouts=_choices(supports, "layouts", LAYOUTS, ("bshd",), where),
        dtypes=_choices(supports, "dtypes", DTYPES, ("fp32", "fp16", "bf16"), where),
        partial=bool(supports.get("partial", True)),
        positions=_choices(supports, "positions", POSITION_KINDS, POSITION_KINDS, where),
        backward=bool(supports.get("backward", False)),
        devices=_choices(supports, "devices", DEVICES, ("cuda",), where),
        tensors_per_launch=2 if with_k else 1, check=check,
        caller_work="given the case's tensors, full-width cos/sin tables and int64 positions")


def load(target: str) -> PeerSpec:
    """The spec for ``--impl module:function`` (``function`` may be dotted: ``module:Cls.fn``);
    :class:`BadImpl` with one line saying what is wrong and what would be right."""
    problem = _impl_target.problem(target)
    if problem:
        raise BadImpl(f"--impl {target}: {problem}")
    module_name, _, attr = (part.strip() for part in target.partition(":"))
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # found, but importing it failed
        first = (str(exc).strip().splitlines() or [""])[0][:120]
        raise BadImpl(f"--impl {target}: cannot import module {module_name!r} "
                      f"({type(exc).__name__}: {first}); fix the module, or install what it "
                      "imports") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BadImpl(f"--impl {target}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return spec_from_callable(obj, target)


def entry_point_specs() -> list[PeerSpec]:
    """Specs for the entry points of group ``rope_ports.impls`` of the installed packages; one
    that fails to load is left out with a warning naming it (it must not stop the study)."""
    import warnings

    specs = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {ep.name} = {ep.value}"
        try:
            specs.append(spec_from_callable(ep.load(), where))
        except Exception as exc:
            warnings.warn(f"{where} left out: {type(exc).__name__}: {exc}", stacklevel=2)
    return specs
