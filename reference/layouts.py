"""Tensor layouts and how a per-token position broadcasts over each of them.

``sbhd`` [S, B, H, D], ``bshd`` [B, S, H, D], ``bhsd`` [B, H, S, D], and ``thd`` [T, H, D]: the
tokens of several sequences packed along T, with ``cu_seqlens`` [B + 1] (int32) marking where
each sequence starts.
"""
from __future__ import annotations

import torch

from reference.vocabulary import BSH_AXES, LAYOUTS, Layout, check_choice


def shape_of(layout: Layout, b: int, s: int, h: int, d: int, total_tokens: int | None = None
             ) -> tuple[int, ...]:
    """The tensor shape of ``b`` sequences of ``s`` tokens, ``h`` heads of ``d`` channels.

    For thd, ``total_tokens`` is the packed token count (``b * s`` when not given).
    """
    check_choice("layout", layout, LAYOUTS)
    if layout == "thd":
        return (b * s if total_tokens is None else total_tokens, h, d)
    shape = [0, 0, 0, d]
    for axis, size in zip(BSH_AXES[layout], (b, s, h)):
        shape[axis] = size
    return tuple(shape)


def positions_for_layout(positions: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Reshape per-token positions (``[B, S]``, or ``[T]`` for thd) to broadcast against x[..., 0].

    thd gives ``[T, 1]``; a dense layout gives ``[B, S, 1]`` with its axes put in the layout's
    order (``[S, B, 1]`` for sbhd, ``[B, 1, S]`` for bhsd).
    """
    check_choice("layout", layout, LAYOUTS)
    if layout == "thd":
        return positions[:, None]
    bsh_at_axis = sorted(range(3), key=lambda i: BSH_AXES[layout][i])  # which of b, s, h per axis
    return positions[:, :, None].permute(*bsh_at_axis)
