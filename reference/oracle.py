"""The float64 oracle: RoPE with arbitrary per-element cos/sin, both conventions, partial rotary.

For element ``k < R`` with partner ``p`` (``rot`` below), ``y_k = x_k c_k + rot(x)_k s_k``; the tail
``R <= k < D`` passes through untouched. cos/sin are *full-width per-element* tables, so tables
whose two members differ (used to expose backward bugs) are handled exactly; the backward is the
exact transpose, taken by autograd on this function.
"""
from __future__ import annotations

import torch

from reference.layouts import positions_for_layout
from reference.vocabulary import STYLES, check_choice


def rotate(x: torch.Tensor, style: str) -> torch.Tensor:
    """``rot(x)``: rotate-half ``[-x2, x1]`` or interleaved ``[-x1, x0, -x3, x2, ...]``."""
    check_choice("style", style, STYLES)
    if style == "rotate_half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)
    pairs = x.unflatten(-1, (-1, 2))  # interleaved
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate the first ``R = cos.shape[-1]`` channels of ``x``; cos/sin broadcast to x[..., :R].

    Computes in the promoted dtype of its arguments; the oracle calls it with float64.
    """
    rotary_dim = cos.shape[-1]
    if sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    if rotary_dim % 2 or rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {x.shape[-1]}")
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    y_rot = x_rot * cos + rotate(x_rot, style) * sin
    return torch.cat([y_rot, x_pass.to(y_rot.dtype)], dim=-1)


def gather_tables(cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                  layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos/sin rows broadcastable against x in ``layout`` (one head axis of size 1)."""
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos_table.shape[0]):
        raise IndexError(
            f"positions span [{int(positions.min())}, {int(positions.max())}] but the cos/sin "
            f"table has {cos_table.shape[0]} rows")
    idx = positions_for_layout(positions, layout)
    return cos_table[idx], sin_table[idx]


def rope_oracle(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                positions: torch.Tensor, *, layout: str, style: str) -> torch.Tensor:
    """float64 RoPE of ``x`` (any layout) with table rows selected by per-token ``positions``."""
    cos, sin = gather_tables(cos_table.to(torch.float64), sin_table.to(torch.float64),
                             positions, layout)
    return apply_rope(x.to(torch.float64), cos, sin, style)


def rope_oracle_backward(x: torch.Tensor, grad: torch.Tensor, cos_table: torch.Tensor,
                         sin_table: torch.Tensor, positions: torch.Tensor, *, layout: str,
                         style: str) -> torch.Tensor:
    """float64 gradient of :func:`rope_oracle` w.r.t. ``x``, by autograd (the exact transpose)."""
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    y = rope_oracle(x64, cos_table, sin_table, positions, layout=layout, style=style)
    (dx,) = torch.autograd.grad(y, x64, grad.to(torch.float64))
    return dx
