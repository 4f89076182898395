"""Builders for inverse frequencies, angles and cos/sin tables.

Everything is computed in float64 and rounded once, at the end, to the requested dtype.
Conventions (R = rotary_dim, half = R // 2):

* ``rotate_half`` (NeoX / HF-Llama): pairs ``(i, i + half)``; the natural full-width table is
  *concatenated*: ``[theta_0 .. theta_{half-1}, theta_0 .. theta_{half-1}]``.
* ``interleaved`` (GPT-J / Meta-Llama complex): pairs ``(2i, 2i + 1)``; the natural full-width
  table is *duplicated*: ``[theta_0, theta_0, theta_1, theta_1, ...]``.
"""
from __future__ import annotations

import math

import torch

from reference.vocabulary import STYLES, Style, check_choice


def inv_freq(rotary_dim: int, base: float = 10000.0, *, dtype: torch.dtype = torch.float64,
             device: torch.device | str | None = None) -> torch.Tensor:
    """``base ** (-2j / R)`` for ``j = 0 .. R/2 - 1``, shape ``[R/2]``."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    return (1.0 / (float(base) ** exponent)).to(dtype)


def llama31_inv_freq(rotary_dim: int, base: float = 500000.0, *, rope_scale: float = 8.0,
                     low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                     old_context_len: float = 8192.0, dtype: torch.dtype = torch.float64,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Llama 3.1's scaled inverse frequencies, ``[R/2]``, computed in float64.

    Each frequency ``f = base ** (-2j / R)`` is blended with ``f / rope_scale`` by the clamped
    ramp ``s = clamp(old_context_len * f / (2 pi (high - low)) - low / (high - low), 0, 1)``:
    ``f' = (1 - s) f / rope_scale + s f``. Wavelengths ``2 pi / f`` shorter than
    ``old_context_len / high_freq_factor`` keep ``f`` (s = 1), those longer than
    ``old_context_len / low_freq_factor`` take ``f / rope_scale`` (s = 0). This is FlashInfer's
    form (``smooth_a``, ``smooth_b`` in ``pos_enc.cuh``) of the definition transformers writes
    with branches as ``_compute_llama3_parameters``; the defaults are Llama 3.1's.
    """
    if low_freq_factor <= 0 or high_freq_factor <= low_freq_factor:
        raise ValueError(f"need 0 < low_freq_factor < high_freq_factor, got {low_freq_factor}, "
                         f"{high_freq_factor}")
    if rope_scale <= 0 or old_context_len <= 0:
        raise ValueError(f"rope_scale and old_context_len must be positive, got {rope_scale}, "
                         f"{old_context_len}")
    freq = inv_freq(rotary_dim, base, device=device)
    span = high_freq_factor - low_freq_factor
    smooth = (old_context_len * freq / (2 * math.pi * span) - low_freq_factor / span).clamp(0, 1)
    return ((1 - smooth) * freq / rope_scale + smooth * freq).to(dtype)


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
