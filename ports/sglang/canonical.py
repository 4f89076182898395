"""The SGLang port as registry entries (family ``sglang``):

* ``sglang.cos_sin_cache_inplace``: per-token positions (int64) and FlashInfer's
  fp32 ``cat(cos, sin)`` cache ``[L, R]``: the case's tables, one value per pair, converted to
  fp32 once in ``prepare`` (exact for fp32 and x-dtype tables; fp64 tables are rounded, as a
  model's fp32 cache is); q and k in one launch, in place; head dims 64, 128, 256, 512, fp16
  and bf16. The port's host check of the positions' range (a device sync the original does not
  have) runs once in ``prepare``; the timed call skips it (``check_positions_on_host=False``), so
  it does the original's work.
* ``sglang.rotary_embedding``: the any-head-size kernel (head size 80), in place, with cos/sin
  rows gathered per token in ``prepare`` (outside the timed call, as SGLang's callers pass
  them): ``[T, R/2]`` per pair for interleaved (the original's ``is_neox=True``), ``[T, R]`` per
  element for rotate-half (``is_neox=False``); tables in x's dtype; contiguous q and k.

Both rotate copies of the case's tensors made in ``prepare``: the first call is the one
validated, later timed calls rotate the same buffers again (as the in-place peers do).
"""
from __future__ import annotations

import torch

from ports._spec import ImplSpec
from ports.sglang import UPSTREAM
from ports.sglang._launch import HEAD_DIMS, vector_layout
from reference.case import RopeCase, RopeInputs
from reference.tables import first_members
from reference.vocabulary import INT32_MAX, KERNEL_DTYPES

BOTH = frozenset({"rotate_half", "interleaved"})
TOKEN_LAYOUTS = frozenset({"bshd", "thd"})
ALL_POSITIONS = frozenset({"arange", "offset", "ids"})


def _token_view(case: RopeCase, x: torch.Tensor) -> torch.Tensor:
    """x as ``[tokens, h, d]`` (thd as is; bshd's ``b, s`` flattened, a view)."""
    return x if case.layout == "thd" else x.flatten(0, 1)


def _in_place(inputs: RopeInputs, rotate):
    """``rotate(buffers)`` on copies of the case's tensors made here; returns the buffers."""
    buffers = [x.clone() for x in inputs.xs]

    def call():
        rotate(buffers)
        return tuple(buffers)
    return call


def _q_and_k_only(case: RopeCase) -> str | None:
    if case.kv_heads is None:
        return "rotates q and k in one call: needs a k (kv_heads)"
    if case.with_v:
        return "rotates q and k only (no v)"
    return None


def _cache_limits(case: RopeCase) -> str | None:
    reason = _q_and_k_only(case)
    if reason:
        return reason
    if case.head_dim not in HEAD_DIMS:
        return (f"head_dim {case.head_dim} not in {HEAD_DIMS} (FlashInfer's dispatch; "
                "sglang.rotary_embedding takes any head size)")
    vec_size, _, _ = vector_layout(case.head_dim, case.torch_dtype.itemsize)
    step = vec_size if case.style == "interleaved" else 2 * vec_size
    if case.rot_dim % step:
        return f"rotary_dim {case.rot_dim} not a multiple of {step} (a thread's vector)"
    return None


def _prepare_cache(case: RopeCase, inputs: RopeInputs):
    from ports import sglang

    half = lambda t: first_members(t, case.style).to(torch.float32)  # noqa: E731
    cache = torch.cat([half(inputs.cos), half(inputs.sin)], dim=-1).contiguous()
    positions = inputs.positions.reshape(-1).long()
    sglang.check_positions(positions, cache.size(0))  # once here: the timed call has no sync
    is_neox = case.style == "rotate_half"

    def rotate(xs):
        q, k = (_token_view(case, x) for x in xs)
        sglang.apply_rope_with_cos_sin_cache_inplace(positions, q.flatten(-2), k.flatten(-2),
                                                     case.head_dim, cache, is_neox=is_neox,
                                                     check_positions_on_host=False)
    return _in_place(inputs, rotate)


def _any_head_limits(case: RopeCase) -> str | None:
    if case.with_v:
        return "rotates q and k only (no v)"
    if case.table_dtype != case.torch_dtype:
        return "cos/sin must be in x's dtype (the kernel reads them as x's type)"
    if case.asymmetric and case.style == "interleaved":
        return "interleaved takes one cos/sin per pair (cannot use asymmetric tables)"
    if case.tokens * max(case.head_counts) * case.head_dim > INT32_MAX:
        return "int32 token offsets: the tensor is past 2^31 elements"
    return None


def _prepare_any_head(case: RopeCase, inputs: RopeInputs):
    from ports import sglang

    positions = inputs.positions.reshape(-1)
    is_neox = case.style == "interleaved"  # the original's name: True pairs (2i, 2i + 1)
    if is_neox:
        cos, sin = (first_members(t, case.style)[positions].contiguous()
                    for t in (inputs.cos, inputs.sin))                      # [T, R/2]
    else:
        cos, sin = inputs.cos[positions].contiguous(), inputs.sin[positions].contiguous()  # [T, R]

    def rotate(xs):
        q = _token_view(case, xs[0])
        k = _token_view(case, xs[1]) if len(xs) > 1 else None
        sglang.rotary_embedding(cos, sin, q, k, case.head_dim, is_neox)
    return _in_place(inputs, rotate)


def _specs() -> list[ImplSpec]:
    common = dict(family="sglang", backend="cupy", upstream=UPSTREAM, styles=BOTH,
                  layouts=TOKEN_LAYOUTS, partial=True, positions=ALL_POSITIONS, backward=False,
                  tensors_per_launch=2)
    return [
        ImplSpec(
            name="sglang.cos_sin_cache_inplace",
            summary="sgl-kernel apply_rope_with_cos_sin_cache_inplace: FlashInfer's vector "
                    "layout (SGLang's Enhanced kernels), fp32 cat(cos, sin) cache, in place",
            prepare=_prepare_cache, dtypes=frozenset({"fp16", "bf16"}), check=_cache_limits,
            launch="block (bdx, bdy): bdx = head_dim / vec threads per head, 128 threads; grid "
                   "(tokens / bdy) looping over heads, or (tokens / bdy, q + k heads) below one "
                   "wave (occupancy x SMs)",
            per_thread="a vector of vec_size elements (16 bytes) of one head",
            access="16-byte vector loads/stores of x; float4 loads of the cache row",
            math="fp32 from an fp32 cache, one rounding; built with -use_fast_math",
            **common),
        ImplSpec(
            name="sglang.rotary_embedding",
            summary="sgl-kernel rotary_embedding (any head size, e.g. 80): per-token cos/sin rows "
                    "in x's dtype, gathered outside the timed call; in place",
            prepare=_prepare_any_head, dtypes=frozenset(KERNEL_DTYPES), strided=False,
            asymmetric_tables=True, index_bits=32, check=_any_head_limits,
            launch="one block per token, min(max pairs per token, 512) threads over (head, pair)",
            per_thread="one pair per stride step", access="scalar loads (__ldg for cos/sin)",
            math="fp32 from cos/sin in x's dtype, one rounding; built with -use_fast_math",
            **common),
    ]


SPECS = _specs()
