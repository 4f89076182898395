"""Host-side helpers the Triton ports share: checks before launch, a device guard, a compile count.

Triton kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (Triton reads
the variable when a kernel is *defined*, so it must be set before the port is imported; the tests'
``conftest.py`` and ``compare.py`` do so on machines without a GPU).
"""
from __future__ import annotations

import contextlib
import os

import torch

from reference.vocabulary import check_dtype
# Re-exported for callers that still import it from here; new code imports reference.vocabulary.
from reference.vocabulary import check_rank  # noqa: F401

MAX_GRID_X = 2**31 - 1  # CUDA's limit on gridDim.x (a Triton grid's first axis)
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (a Triton grid's second axis)


def is_pow2(n) -> bool:
    """A positive int power of two (what ``tl.arange`` and the block-size constexprs need)."""
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ---- TransformerEngine's tensor formats (te_triton and batch_reuse take TE's API) -------------
TE_FORMATS = ("sbhd", "bshd")


def check_te_format(tensor_format: str) -> None:
    if tensor_format not in TE_FORMATS:
        raise ValueError(f"tensor_format must be one of {TE_FORMATS}, got {tensor_format!r}")


def sbhd_strides(t: torch.Tensor, tensor_format: str) -> tuple[int, int, int, int]:
    """``t``'s strides in (s, b, h, d) order, for a 4-D tensor in TE format sbhd or bshd."""
    s0, s1, s2, s3 = t.stride()
    return (s0, s1, s2, s3) if tensor_format == "sbhd" else (s1, s0, s2, s3)


def output_like(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked against x (same dtype and shape), or a new (poisonable) tensor like x."""
    from ports import _alloc

    if out is None:
        return _alloc.empty(x.shape, dtype=x.dtype, device=x.device)
    check_dtype(out, "out", (x.dtype,))
    if out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, x has {tuple(x.shape)}")
    return out


def check_device(*named: tuple[str, torch.Tensor]) -> torch.device:
    """All tensors on one device: CUDA, or CPU under the Triton interpreter. Returns the device."""
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        where = ", ".join(f"{n} on {t.device}" for n, t in named)
        raise ValueError(f"tensors must share one device: {where}")
    device = devices.pop()
    if device.type == "cuda":
        return device
    if device.type == "cpu" and interpreting():
        return device
    raise ValueError(f"Triton kernels need CUDA tensors (or CPU tensors under TRITON_INTERPRET=1 "
                     f"set before import); got {device}")


def device_guard(device: torch.device):
    """Launch on the tensors' GPU, not the current one (no-op for the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def compiled_count(kernel) -> int:
    """How many specialisations of a ``@triton.jit`` kernel have been compiled (all devices).

    flash-attn's ``test_compilation_count`` idea: a shape change that should be dynamic must not
    add one. (Interpreted kernels have no cache: returns 0.)
    """
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return 0
    return sum(len(entry[0]) for entry in caches.values())
