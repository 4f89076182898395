"""What the fastrope probes under tools/ share (GPU only): their inputs.

Not a tool itself; the tools import it (run them from the repository root with ``python -m``).
Kernel variants and fixed plans come from the package's experiment interface,
``ports.fastrope.experiment``.
"""
from __future__ import annotations

import torch

__all__ = ["decode_inputs", "make"]


def make(layout, shape, dtype):
    """x in ``layout`` for ``shape`` (b, s, h, d) and full-width rotate-half tables in x's dtype
    (angles from base 10000 in fp64)."""
    b, s, h, d = shape
    x = torch.randn((s, b, h, d) if layout == "sbhd" else (b, s, h, d), device="cuda", dtype=dtype)
    ang = torch.arange(s, device="cuda", dtype=torch.float64)[:, None] * (
        10000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float64) / d))
    ang = torch.cat([ang, ang], -1)
    return x, ang.cos().to(dtype), ang.sin().to(dtype)


def decode_inputs(b=64):
    """A decode step: x [b, 1, 32, 128] bf16, 4k-row tables, one offset per sequence, and the
    rows torch.compile's call gets gathered beforehand."""
    x = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    _, cos, sin = make("bshd", (1, 4096, 1, 128), torch.bfloat16)
    offs = torch.randint(0, 4095, (b,), device="cuda")
    return x, cos, sin, offs, cos[offs][:, None, :], sin[offs][:, None, :]

