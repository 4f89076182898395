"""Tensor layouts and how a per-token position broadcasts over each of them.

``sbhd`` [S, B, H, D], ``bshd`` [B, S, H, D], ``bhsd`` [B, H, S, D], and ``thd`` [T, H, D]: the
tokens of several sequences packed along T, with ``cu_seqlens`` [B + 1] (int32) marking where
each sequence starts.
"""
from __future__ import annotations

from typing import Literal

import torch

Layout = Literal["sbhd", "bshd", "bhsd", "thd"]
LAYOUTS: tuple[str, ...] = ("sbhd", "bshd", "bhsd", "thd")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def shape_of(layout: str, b: int, s: int, h: int, d: int, total_tokens: int | None = None
             ) -> tuple[int, ...]:
    """The tensor shape of ``b`` sequences of ``s`` tokens, ``h`` heads of ``d`` channels."""
    check_layout(layout)
    if layout == "sbhd":
        return (s, b, h, d)
    if layout == "bshd":
        return (b, s, h, d)
    if layout == "bhsd":
        return (b, h, s, d)
    return (b * s if total_tokens is None else total_tokens, h, d)


def positions_for_layout(positions: torch.Tensor, layout: str) -> torch.Tensor:
    """Reshape per-token positions (``[B, S]``, or ``[T]`` for thd) to broadcast against x[..., 0]."""
    check_layout(layout)
    if layout == "thd":
        return positions[:, None]                # [T, 1]
    if layout == "bshd":
        return positions[:, :, None]             # [B, S, 1]
    if layout == "sbhd":
        return positions.t()[:, :, None]         # [S, B, 1]
    return positions[:, None, :]                 # bhsd: [B, 1, S]


def to_bshd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A [B, S, H, D] view of a dense-layout tensor (no copy). thd has no such view."""
    check_layout(layout)
    if layout == "bshd":
        return x
    if layout == "sbhd":
        return x.transpose(0, 1)
    if layout == "bhsd":
        return x.transpose(1, 2)
    raise ValueError("thd has no [B, S, H, D] view; use cu_seqlens")


def from_bshd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of :func:`to_bshd` (a view)."""
    return to_bshd(x, layout)  # each permutation above is its own inverse
