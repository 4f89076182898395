"""The FlashInfer port as registry entries: ``flashinfer_port.apply_rope`` (indptr + offsets),
``flashinfer_port.pos_ids`` and ``flashinfer_port.cos_sin_cache``, each with its ``_inplace``
twin; family ``flashinfer_port``.

The inputs are those ``ports/peers/canonical.py`` gives the installed ``flashinfer`` rows, in the
same table form, so a port row and its peer row compare on equal inputs: q and k as ``(tokens,
heads, head_dim)`` views (bshd flattened, thd as is; cut from a packed qkv when the case is not
contiguous); ``indptr`` from ``cu_seqlens`` (thd) or one segment per sequence, ``offsets`` and
``pos_ids`` as int32; the cache as ``cat(cos, sin)`` of the case's half-width tables in fp32
(FlashInfer takes only fp32; tables in x's fp16/bf16 widen to it exactly, so those cases run on
the same table values as the others, where the installed peer row refuses them). The
computed-angle rows compute their own angles from ``rope_theta`` (``__powf`` / ``__sincosf``).
In-place rows run on copies made in ``prepare``: the first call is the one validated.
The port's host reads of ``indptr`` and of the positions' range (device syncs the original does
not have) run once in ``prepare``; the timed calls skip them, so they do the original's work. A case
without k (``kv_heads`` None) passes a k of 0 heads, which the original's API accepts (the
kernels loop over, or launch blocks for, no k heads); the installed peer rows need a k.
"""
from __future__ import annotations

import torch

from ports._spec import ImplSpec
from ports.flashinfer_port import UPSTREAM
from ports.flashinfer_port._launch import (
    HEAD_DIMS, MAX_GRID_Y, check_indptr, check_positions, vector_layout,
)
from reference.case import RopeCase, RopeInputs
from reference.tables import first_members
from reference.tolerances import ANGLE_REL_ERR_FAST_MATH

HALF_DTYPES = frozenset({"fp16", "bf16"})
TOKEN_LAYOUTS = frozenset({"bshd", "thd"})


def _limits(case: RopeCase) -> str | None:
    if case.with_v:
        return "rotates q and k only (no v)"
    if case.head_dim not in HEAD_DIMS:
        return (f"head_dim {case.head_dim} not in the kernels' dispatch "
                f"({', '.join(map(str, HEAD_DIMS))})")
    vec_size, _, _ = vector_layout(case.head_dim, 2)
    step = vec_size if case.style == "interleaved" else 2 * vec_size
    if case.rot_dim % step:
        return f"rotary_dim must be a multiple of {step} (whole {vec_size}-element vectors)"
    if case.heads + (case.kv_heads or 0) > MAX_GRID_Y:
        return f"{case.heads + (case.kv_heads or 0)} heads exceed the head-parallel grid's y limit"
    return None


def _token_view(case: RopeCase, x: torch.Tensor) -> torch.Tensor:
    """x as ``(tokens, heads, head_dim)``: thd as is, bshd's ``b, s`` flattened (a view)."""
    return x if case.layout == "thd" else x.flatten(0, 1)


def _prepare(form: str, inplace: bool):
    def prepare(case: RopeCase, inputs: RopeInputs):
        from ports import flashinfer_port as fi

        interleave = case.style == "interleaved"
        computed = dict(rotary_dim=case.rot_dim, interleave=interleave, rope_scale=1.0,
                        rope_theta=float(case.base))
        if form == "indptr":
            indptr = (inputs.cu_seqlens if case.layout == "thd" else torch.arange(
                0, case.tokens + 1, case.seqlen, device=inputs.x.device)).to(torch.int32)
            offsets = inputs.offsets.to(torch.int32)
            check_indptr(indptr, case.tokens)  # once here: the timed call has no sync
            fn = fi.apply_rope_inplace if inplace else fi.apply_rope
            call = lambda q, k: fn(q, k, indptr, offsets, check_indptr_on_host=False,  # noqa: E731
                                   **computed)
        elif form == "pos_ids":
            pos_ids = inputs.positions.reshape(-1).to(torch.int32)
            fn = fi.apply_rope_pos_ids_inplace if inplace else fi.apply_rope_pos_ids
            call = lambda q, k: fn(q, k, pos_ids, **computed)  # noqa: E731
        else:
            half = lambda t: first_members(t, case.style)  # noqa: E731
            cache = torch.cat([half(inputs.cos), half(inputs.sin)], dim=-1).to(torch.float32)
            cache = cache.contiguous()
            positions = inputs.positions.reshape(-1)
            check_positions(positions, cache.size(0))  # once here: the timed call has no sync
            fn = (fi.apply_rope_with_cos_sin_cache_inplace if inplace
                  else fi.apply_rope_with_cos_sin_cache)

            def call(q, k):  # k of 0 heads stays 3-D: a 0-element view cannot infer its heads
                return fn(positions, q.flatten(-2), k if k.size(1) == 0 else k.flatten(-2),
                          case.head_dim, cache, is_neox=not interleave,
                          check_positions_on_host=False)

        def rotate(xs):
            q = _token_view(case, xs[0])
            k = (_token_view(case, xs[1]) if len(xs) > 1
                 else q.new_empty((q.shape[0], 0, case.head_dim)))
            outs = call(q, k)
            outs = (q, k) if inplace else outs
            return tuple(o.view(x.shape) for o, x in zip(outs, xs))

        if inplace:
            buffers = [x.clone() for x in inputs.xs]
            return lambda: rotate(buffers)
        return lambda: rotate(inputs.xs)
    return prepare


def _specs() -> list[ImplSpec]:
    common = dict(
        family="flashinfer_port", backend="cupy", upstream=UPSTREAM,
        styles=frozenset({"rotate_half", "interleaved"}), layouts=TOKEN_LAYOUTS,
        dtypes=HALF_DTYPES, partial=True, backward=False, tensors_per_launch=2, check=_limits,
        per_thread="vec_size = max(8, D/32) elements (one 16-byte vector, 32 bytes at D = 512)",
        access="16-byte vector loads and stores; token and head strides free, last dim contiguous")
    pos_launch = ("block (D/vec, 128/(D/vec)): sequential heads, grid (ceil(nnz / bdy)), when those "
                  "blocks fill the GPU's resident slots, else head-parallel, grid "
                  "(ceil(nnz / bdy), Hq + Hk)")
    forms = (
        ("indptr", "apply_rope", frozenset({"arange", "offset"}), "computed",
         "indptr (segments) + per-segment offsets",
         "one block per (segment, head): grid (B * (Hq + Hk)), block (D/vec, 128/(D/vec)) "
         "stepping through the segment"),
        ("pos_ids", "pos_ids", frozenset({"arange", "offset", "ids"}), "computed",
         "per-token pos_ids", pos_launch),
        ("cache", "cos_sin_cache", frozenset({"arange", "offset", "ids"}), "tables",
         "per-token positions + fp32 cat(cos, sin) cache", pos_launch),
    )
    specs = []
    for form, short, positions, source, what, launch in forms:
        computed = source == "computed"
        for inplace in (False, True):
            specs.append(ImplSpec(
                name=f"flashinfer_port.{short}{'_inplace' if inplace else ''}",
                summary=f"FlashInfer port {short}{' (in place)' if inplace else ''}: {what}",
                prepare=_prepare(form, inplace), positions=positions, table_source=source,
                table_dtypes=None if computed else frozenset({"fp32", "same"}),
                angle_rel_err=ANGLE_REL_ERR_FAST_MATH if computed else 0.0, launch=launch,
                math=("fp32; angles from rope_theta with __powf / __sincosf (fast math)"
                      if computed else "fp32; cat(cos, sin) fp32 cache rows"),
                **common))
    return specs


SPECS = _specs()
