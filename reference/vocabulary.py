"""The study's vocabulary, defined once: conventions, layouts, dtypes, position kinds, and the
host checks every port's API shares.

Canonical names are what ``compare.py`` and :class:`reference.case.RopeCase` take; each port maps
them to its original's own names at its boundary.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

# ---- conventions and layouts -----------------------------------------------------------------
Style = Literal["rotate_half", "interleaved"]
STYLES: tuple[str, ...] = ("rotate_half", "interleaved")

Layout = Literal["sbhd", "bshd", "bhsd", "thd"]
LAYOUTS: tuple[str, ...] = ("sbhd", "bshd", "bhsd", "thd")
DENSE_LAYOUTS: tuple[str, ...] = ("sbhd", "bshd", "bhsd")  # one tensor axis per b, s, h, d
# Tensor dims of (batch, sequence, head) in each dense layout.
BSH_AXES: dict[str, tuple[int, int, int]] = {
    "bshd": (0, 1, 2), "sbhd": (1, 0, 2), "bhsd": (0, 2, 1)}
# The axis that walks the tokens (thd packs every sequence's tokens along axis 0).
TOKEN_AXIS: dict[str, int] = {"sbhd": 0, "bshd": 1, "bhsd": 2, "thd": 0}
HEAD_AXIS: dict[str, int] = {"sbhd": 2, "bshd": 2, "bhsd": 1, "thd": 1}
# How error messages name each layout's dims.
DIM_NAMES: dict[str, str] = {
    "bshd": "b, s, h, d", "sbhd": "s, b, h, d", "bhsd": "b, h, s, d", "thd": "t, h, d"}

# ---- dtypes ----------------------------------------------------------------------------------
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp64": torch.float64,
}
KERNEL_DTYPES: tuple[str, ...] = ("fp32", "fp16", "bf16")  # what the GPU kernels take
KERNEL_TORCH_DTYPES: tuple[torch.dtype, ...] = tuple(DTYPES[n] for n in KERNEL_DTYPES)
COS_SIN_DTYPES: tuple[str, ...] = ("fp32", "fp64", "same")  # "same": x's dtype
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)

# ---- positions, directions, gradients --------------------------------------------------------
POSITION_KINDS: tuple[str, ...] = ("arange", "offset", "ids")
DIRECTIONS: tuple[str, ...] = ("forward", "backward")
GRAD_KINDS: tuple[str, ...] = ("random", "broadcast")

INT32_MAX = 2**31 - 1  # the largest offset a 32-bit index design can hold


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise TypeError(f"unsupported dtype {dtype}")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- host checks the ports' APIs share -------------------------------------------------------
def check_choice(what: str, value: str, choices: Iterable[str]) -> None:
    """A ValueError unless ``value`` is one of ``choices``, naming them:
    ``check_choice("layout", layout, LAYOUTS)``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of {choices}")


def check_tensor(t, name: str) -> None:
    """A TypeError unless ``t`` is a torch.Tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_dtype(t: torch.Tensor, name: str,
                allowed: Iterable[torch.dtype] = KERNEL_TORCH_DTYPES) -> None:
    """A TypeError naming ``name``'s dtype and the allowed ones (or saying it is no tensor).

    ``allowed`` defaults to the float dtypes the GPU kernels take.
    """
    check_tensor(t, name)
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {_short(t.dtype)}; this port supports "
                        + ", ".join(_short(a) for a in allowed))


def check_rank(t: torch.Tensor, name: str, rank: int, dims: str = "") -> None:
    """A ValueError naming ``name``'s shape and the expected rank (and dims, if given)."""
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D{f' [{dims}]' if dims else ''}, got shape "
                         f"{tuple(t.shape)}")
