"""Output allocation shared by the ports, with a switch that poisons fresh outputs with NaN.

Ports allocate through :func:`empty` so the harness and the tests can prove that a kernel wrote
every element: under :func:`poisoned` each new output starts as NaN (integers as -1).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_poison_depth = 0


def empty(shape, *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if _poison_depth:
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of t's shape, dtype and device."""
    return empty(t.shape, dtype=t.dtype, device=t.device)


def poisoning() -> bool:
    """Whether outputs allocated now should be poisoned (inside :func:`poisoned`): for ports that
    allocate their outputs themselves."""
    return _poison_depth > 0


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """Within this block, outputs from :func:`empty` are filled with NaN."""
    global _poison_depth
    _poison_depth += 1
    try:
        yield
    finally:
        _poison_depth -= 1
