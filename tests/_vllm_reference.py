"""A small float64 reference for vLLM's ``rotary_embedding`` op, written from the op's semantics
(vLLM's ``RotaryEmbedding.forward_native``: gather the cache row per token, split it into the cos
half and the sin half, rotate), not from the kernel's index math: tensor ops on ``[T, h, d]``.

NeoX pairs ``(i, i + R/2)``, GPT-J pairs ``(2i, 2i+1)``; both read ``cos[i]``/``sin[i]`` for pair
``i``. The rotated channels are ``[offset, offset + R)``; the rest pass through; ``inverse`` negates
the sine.
"""
from __future__ import annotations

import torch


def rotate_tokens(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, *,
                  is_neox: bool, rope_dim_offset: int = 0, inverse: bool = False
                  ) -> torch.Tensor:
    """float64 result for ``x`` ``[T, h, d]``, positions ``[T]``, cache ``[L, R]``."""
    x = x.to(torch.float64)
    rot = cache.shape[1]
    rows = cache.to(torch.float64)[positions.reshape(-1)]          # [T, R]
    cos, sin = rows[:, None, : rot // 2], rows[:, None, rot // 2:]  # [T, 1, R/2]
    if inverse:
        sin = -sin
    part = x[..., rope_dim_offset: rope_dim_offset + rot]
    if is_neox:
        a, b = part[..., : rot // 2], part[..., rot // 2:]
    else:
        a, b = part[..., 0::2], part[..., 1::2]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    rotated = (torch.cat([ra, rb], -1) if is_neox
               else torch.stack([ra, rb], -1).flatten(-2))
    out = x.clone()
    out[..., rope_dim_offset: rope_dim_offset + rot] = rotated
    return out


def cache_for(max_position: int, rot_dim: int, base: float = 10000.0,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """vLLM's ``_compute_cos_sin_cache``: ``cat(cos, sin)`` of ``p * base^(-2i/R)``, computed in
    float64 then stored in ``dtype``."""
    inv = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv
    return torch.cat([ang.cos(), ang.sin()], -1).to(dtype)
