"""Builders for inverse frequencies, angles and cos/sin tables.

Everything is computed in float64 and rounded once, at the end, to the requested dtype.
Conventions (R = rotary_dim, half = R // 2):

* ``rotate_half`` (NeoX / HF-Llama): pairs ``(i, i + half)``; the natural full-width table is
  *concatenated*: ``[theta_0 .. theta_{half-1}, theta_0 .. theta_{half-1}]``.
* ``interleaved`` (GPT-J / Meta-Llama complex): pairs ``(2i, 2i + 1)``; the natural full-width
  table is *duplicated*: ``[theta_0, theta_0, theta_1, theta_1, ...]``.
"""
from __future__ import annotations

import torch

from reference.vocabulary import STYLES, Style, check_choice


def inv_freq(rotary_dim: int, base: float = 10000.0, *, dtype: torch.dtype = torch.float64,
             device: torch.device | str | None = None) -> torch.Tensor:
    """``base ** (-2j / R)`` for ``j = 0 .. R/2 - 1``, shape ``[R/2]``."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    return (1.0 / (float(base) ** exponent)).to(dtype)


def angles(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Outer product ``positions[..., None] * freqs``: shape ``positions.shape + [R/2]``, float64."""
    return positions.to(torch.float64)[..., None] * freqs.to(torch.float64)


def expand_half(half: torch.Tensor, style: Style) -> torch.Tensor:
    """Spread a per-pair ``[..., R/2]`` tensor to the style's natural full width ``[..., R]``."""
    check_choice("style", style, STYLES)
    if style == "rotate_half":
        return torch.cat([half, half], dim=-1)
    return torch.repeat_interleave(half, 2, dim=-1)


def first_members(full: torch.Tensor, style: Style) -> torch.Tensor:
    """The inverse of :func:`expand_half` for symmetric tables: one value per pair, ``[..., R/2]``."""
    check_choice("style", style, STYLES)
    if style == "rotate_half":
        return full[..., : full.shape[-1] // 2]
    return full[..., 0::2]


def cos_sin(angle_half: torch.Tensor, style: Style, dtype: torch.dtype = torch.float32
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width cos and sin tables from per-pair angles, computed in float64 then rounded."""
    a = expand_half(angle_half.to(torch.float64), style)
    return torch.cos(a).to(dtype), torch.sin(a).to(dtype)


def rope_tables(max_position: int, rotary_dim: int, *, base: float = 10000.0,
                style: Style = "rotate_half", dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_position, rotary_dim]`` for positions ``0 .. max_position - 1``."""
    pos = torch.arange(max_position, device=device)
    return cos_sin(angles(pos, inv_freq(rotary_dim, base, device=device)), style, dtype)
