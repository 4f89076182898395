"""A small float64 reference for OneFlow's fused_apply_rotary_emb, written from the semantics of
upstream's test (python/oneflow/test/modules/test_fused_rotary_embedding.py), not from the
kernel's index math: layouts are undone with reshapes and permutes, the rotation with tensor ops.

Semantics (upstream's ``naive_embedding`` and its cos/sin builders): with ``E`` rotary sections
(``position_ids.shape[1]``, 1 or 2) the rotated width ``R`` splits into ``E`` sections of
``Ra = R / E`` channels; section ``s`` uses ``position_ids[b, s, m]`` (default ``m``) and is an
independent rotation of width ``Ra``: plane = rotate-half inside the section (frequency index
``j = kk % (Ra / 2)``), interval = pairs ``(2i, 2i+1)`` (``j = kk // 2``), with
``theta_j = pos * base^(-2j / Ra)``; given tables are read per element at ``[pos, kk]``.
Channels ``[R, K)`` pass through.
"""
from __future__ import annotations

import torch

_PACKED_N = {"(HK)": 1, "(H2K)": 2, "(H3K)": 3}


def to_logical(t: torch.Tensor, layout: str, k: int | None = None, tensor_index: int = 0
               ) -> torch.Tensor:
    """A [B, M, H, K] view of a tensor in a OneFlow layout (the tensor_index slice if packed)."""
    if layout == "BMHK":
        return t
    if layout == "BHMK":
        return t.permute(0, 2, 1, 3)
    if layout == "MBHK":
        return t.permute(1, 0, 2, 3)
    n = _PACKED_N[layout[2:]]
    d0, d1, hidden = t.shape
    v = t.reshape(d0, d1, hidden // (n * k), n, k)
    slot = {1: 0, 2: tensor_index - 1, 3: tensor_index}[n]
    v = v[:, :, :, slot, :]
    return v if layout.startswith("BM") else v.permute(1, 0, 2, 3)


def from_logical(y: torch.Tensor, layout: str) -> torch.Tensor:
    """A dense tensor in an (unpacked) OneFlow layout from a [B, M, H, K] tensor."""
    b, m, h, k = y.shape
    if layout == "BMHK":
        return y.contiguous()
    if layout == "BHMK":
        return y.permute(0, 2, 1, 3).contiguous()
    if layout == "MBHK":
        return y.permute(1, 0, 2, 3).contiguous()
    if layout == "BM(HK)":
        return y.reshape(b, m, h * k).contiguous()
    if layout == "MB(HK)":
        return y.permute(1, 0, 2, 3).reshape(m, b, h * k).contiguous()
    raise ValueError(layout)


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "plane":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def reference(x: torch.Tensor, *, layout: str, mode: str, cos=None, sin=None, position_ids=None,
              rotary_size: int | None = None, base: float = 1e4, tensor_index: int = 0,
              k_size: int | None = None):
    """float64 ``(y, angle, pair)`` in logical [B, M, H, K]: the output, the angle of each rotated
    element (0 for pass-through, ``None`` with given tables) and ``|x_k| + |x_partner|`` (the
    scale of an angle error's effect; 0 for pass-through)."""
    xl = to_logical(x, layout, k_size, tensor_index).to(torch.float64)
    b, m, h, k = xl.shape
    r = k if rotary_size is None else rotary_size
    e = 1 if position_ids is None else position_ids.shape[1]
    ra = r // e
    if position_ids is None:
        pos = torch.arange(m, device=x.device).expand(b, 1, m)
    else:
        pos = position_ids.to(torch.int64)
    y = xl.clone()
    angle = torch.zeros_like(xl)
    pair = torch.zeros_like(xl)
    kk = torch.arange(ra, device=x.device)
    j = kk % (ra // 2) if mode == "plane" else kk // 2
    freq = float(base) ** (-2.0 * j.to(torch.float64) / ra)  # [Ra]
    for s in range(e):
        part = xl[..., s * ra:(s + 1) * ra]
        p = pos[:, s, :]  # [B, M]
        if cos is not None:
            c = cos.to(torch.float64)[p][:, :, None, :]  # [B, M, 1, Ra]
            sn = sin.to(torch.float64)[p][:, :, None, :]
            ang = None
        else:
            ang = p.to(torch.float64)[:, :, None, None] * freq  # [B, M, 1, Ra]
            c, sn = torch.cos(ang), torch.sin(ang)
            angle[..., s * ra:(s + 1) * ra] = ang
        rot = _rotate(part, mode)
        y[..., s * ra:(s + 1) * ra] = part * c + rot * sn
        pair[..., s * ra:(s + 1) * ra] = part.abs() + rot.abs()
    return y, (angle if cos is None else None), pair
