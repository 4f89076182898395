"""The vLLM port as a registry entry: ``vllm_port.rotary_embedding``.

Inputs are those the installed op gets as the peer row ``vllm.rotary_embedding``
(:mod:`ports.peers.canonical`), so the two rows compare on equal inputs: per-token int64
positions (the case's, flattened), tokens as ``[T, h, d]`` views (bshd's ``b, s`` flattened; thd as
is), and the case's own tables as ``cat(cos_half, sin_half)`` ``[L, R]`` in the case's cos/sin dtype
(built once in ``prepare``, as a model builds its cache once). q and k go in one launch; the op is
in place, so it runs on copies made in ``prepare``. The port's host check of the positions' range
(a device sync the original does not have) runs once in ``prepare``; the timed call skips it
(``check_positions_on_host=False``), so it does the original's work. Unlike the Python layer of vLLM, which casts the
cache to x's dtype, the op takes an fp32 cache with fp16/bf16 x, so fp32 tables are accepted too.
The port also takes sbhd, flattened ``s, b`` with the positions in that order (the op takes
tokens in any order); bhsd it cannot take without a copy (no one stride walks its tokens).
"""
from __future__ import annotations

import torch

from ports._adapters import in_place_call
from ports._spec import ImplSpec
from ports.vllm_port import UPSTREAM
from reference.case import RopeCase, RopeInputs
from reference.tables import first_members
from reference.vocabulary import KERNEL_DTYPES


def cache_of(case: RopeCase, inputs: RopeInputs) -> torch.Tensor:
    """vLLM's ``cos_sin_cache`` ``[L, R]``: each row the cos half, then the sin half."""
    return torch.cat([first_members(inputs.cos, case.style),
                      first_members(inputs.sin, case.style)], dim=-1).contiguous()


def token_positions(case: RopeCase, inputs: RopeInputs) -> torch.Tensor:
    """int64 ``[T]`` in the tokens' memory order: ``b, s`` for bshd, ``s, b`` for sbhd (whose
    ``[s, b, h, d]`` flattens to ``[s*b, h, d]`` without a copy), packed order for thd."""
    pos = inputs.positions.t() if case.layout == "sbhd" else inputs.positions
    return pos.reshape(-1).contiguous()


def _limits(case: RopeCase) -> str | None:
    if case.with_v:
        return "rotates q and k only (no v)"
    return None


def _prepare(case: RopeCase, inputs: RopeInputs):
    from ports import vllm_port

    cache = cache_of(case, inputs)
    positions = token_positions(case, inputs)
    vllm_port.check_positions(positions, cache.size(0))  # once here: the timed call has no sync
    is_neox = case.style == "rotate_half"

    def rotate(xs):
        q, k = (x if case.layout == "thd" else x.flatten(0, 1) for x in (xs[0], xs[-1]))
        vllm_port.rotary_embedding(positions, q, k if len(xs) > 1 else None, case.head_dim,
                                   cache, is_neox, check_positions_on_host=False)
        return xs

    return in_place_call(case, inputs, rotate)


SPECS = [
    ImplSpec(
        name="vllm_port.rotary_embedding", family="vllm_port", backend="cupy", upstream=UPSTREAM,
        summary="vLLM rotary_embedding op: block per token, threads over (head, pair) of q then "
                "k; cat(cos, sin) cache; in place",
        prepare=_prepare, styles=frozenset({"rotate_half", "interleaved"}),
        layouts=frozenset({"bshd", "sbhd", "thd"}), dtypes=frozenset(KERNEL_DTYPES), partial=True,
        positions=frozenset({"arange", "offset", "ids"}), backward=False,
        tensors_per_launch=2, table_dtypes=frozenset({"fp32", "same"}), index_bits=64,
        check=_limits,
        launch="grid (tokens), block min(h * R/2, 512); each thread strides over (q head, pair) "
               "then (k head, pair)",
        per_thread="one pair per step", access="scalar loads; cos/sin through __ldg",
        math="fp32 x*cos - y*sin from the cache's dtype, one rounding at the store"),
]
