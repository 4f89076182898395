"""LeetCUDA's toy RoPE kernels (seed 001): ``rope_f32``, ``rope_f32_v2``, ``rope_f32x4_pack``.

Upstream: ``xlite-dev/LeetCUDA@cb6a0497:kernels/rope/rope.cu`` (rope.cu last changed at
``04e331fa``), built by ``kernels/rope/rope.py`` with ``--use_fast_math``. This is an
independent re-implementation of the design (launch shape, math and its order), not a copy.

The API mirrors the torch extension: each function takes ``x`` and a caller-provided ``out``
(float32 ``[seq_len, hidden]``, one sequence of one head), writes ``out`` and returns ``None``.
Positions are the row indices ``0..seq_len-1``, the convention is interleaved (pairs
``(2i, 2i+1)``), and the frequency is ``10000^(-2i/hidden)``, computed in the kernel in fp32 with
fast-math ``powf``/``sinf``/``cosf`` (an angle error of order 1e-7 rad per rad: the tolerance is
:data:`reference.tolerances.ANGLE_REL_ERR_FAST_MATH`).

Launch shapes, as upstream:

=================  ==============================  ==========  ===============================
kernel             grid                            block       thread -> data
=================  ==============================  ==========  ===============================
rope_f32           ceil(seq_len * hidden/2 / 256)  256         one pair (two scalar loads)
rope_f32_v2        seq_len                         hidden/2    one pair; block = token
rope_f32x4_pack    ceil(seq_len * hidden/4 / 256)  256         two pairs (one float4 load)
=================  ==============================  ==========  ===============================

Version trap: before ``e799541b``, and in the only indexed copy of
``DefTruth/CUDA-Learn-Notes`` (``56e2fe96``), the exponent used integer division
(``2 * i / (N * 2)`` = 0) and the angle was ``pos / inv``: every pair rotated by ``pos`` radians.
This port uses the fixed formula.

Departures from upstream (each a safety addition; the math is unchanged):

* Host checks, raised before any launch: CUDA tensors on one device, float32 (upstream checks
  only this), 2-D, contiguous, ``out`` the shape of ``x``, even ``hidden`` (``% 4`` for x4).
* A bounds check (``idx < seq_len * N``) in ``rope_f32`` and ``rope_f32x4_pack``: upstream has
  none and reads/writes past the end unless ``seq_len * N`` is a multiple of 256.
* ``rope_f32x4_pack`` refuses pointers that are not 16-byte aligned (float4 access).
* ``rope_f32_v2`` refuses ``hidden / 2 > 1024`` (the block would exceed 1024 threads).
* Sizes whose int32 offsets (``idx * 2``, ``idx * 4``, ``token_pos * N * 2``) would overflow,
  i.e. ``seq_len * hidden > 2^31 - 1``, are refused with ``NotImplementedError``.
* Empty inputs return without a launch; ``x`` is ``const`` in the kernels.
"""
from __future__ import annotations

import numpy as np
import torch

from ports import _cupy
from reference.vocabulary import INT32_MAX, check_dtype, check_rank, check_tensor

BLOCK_SIZE = 256
MAX_THREADS_PER_BLOCK = 1024

MODULE = _cupy.CudaModule(
    __name__, "rope.cu",
    kernels=("rope_f32_kernel", "rope_f32_v2_kernel", "rope_f32x4_pack_kernel"),
    options=("--use_fast_math",),
)


def _fast_ok(x, out, pack: int, one_block_per_row: bool) -> bool:
    """True only for a valid call (the detailed checks below then say what is wrong)."""
    return (type(x) is torch.Tensor and type(out) is torch.Tensor
            and x.dtype is torch.float32 and out.dtype is torch.float32
            and x.dim() == 2 and x.shape == out.shape and x.is_contiguous()
            and out.is_contiguous() and x.shape[1] % pack == 0
            and x.numel() <= INT32_MAX
            and (not one_block_per_row or x.shape[1] // 2 <= MAX_THREADS_PER_BLOCK)
            and (pack != 4 or (x.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0))
            and x.is_cuda and out.is_cuda and x.get_device() == out.get_device())


def _check(x: torch.Tensor, out: torch.Tensor, pack: int, one_block_per_row: bool = False
           ) -> int:
    """Every host check upstream lacks, before any launch; returns the CUDA device index."""
    if _fast_ok(x, out, pack, one_block_per_row):  # one cheap test for the common, valid call
        return x.get_device()
    for name, t in (("x", x), ("out", out)):
        check_tensor(t, name)
        check_dtype(t, name, (torch.float32,))
        check_rank(t, name, 2, "seq_len, hidden")
        _cupy.check_contiguous(t, name)
    if out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but x has {tuple(x.shape)}")
    hidden = x.shape[1]
    if hidden % pack:
        raise ValueError(f"hidden (head_dim) must be a multiple of {pack} for this kernel, "
                         f"got {hidden}")
    _cupy.check_index_fits(x.numel(), "seq_len * hidden (the largest int32 offset)")
    if one_block_per_row and hidden // 2 > MAX_THREADS_PER_BLOCK:
        raise ValueError(f"rope_f32_v2 launches hidden/2 = {hidden // 2} threads per block; the "
                         f"limit is {MAX_THREADS_PER_BLOCK} (hidden <= 2048)")
    if pack == 4:
        _cupy.check_aligned(x, "x", 16)
        _cupy.check_aligned(out, "out", 16)
    return _cupy.check_cuda(("x", x), ("out", out))


def _launch(kernel: str, x: torch.Tensor, out: torch.Tensor, pack: int,
            one_block_per_row: bool = False) -> None:
    """Check, then launch ``kernel`` with upstream's grid: (seq_len,) x (N,) for the block-per-row
    kernel, else ceil(seq_len * N / 256) x 256, where N = hidden / pack."""
    device = _check(x, out, pack, one_block_per_row)
    if x.numel() == 0:
        return
    seq_len, n = x.shape[0], x.shape[1] // pack
    if one_block_per_row:
        grid, block = (seq_len,), (n,)
    else:
        grid, block = ((seq_len * n + BLOCK_SIZE - 1) // BLOCK_SIZE,), (BLOCK_SIZE,)
    # seq_len and n fit in int32: _check refused seq_len * hidden > 2^31 - 1.
    _cupy.launch(MODULE, kernel, device, grid, block,
                 (_cupy.ptr(x), _cupy.ptr(out), np.int32(seq_len), np.int32(n)))


def rope_f32(x: torch.Tensor, out: torch.Tensor) -> None:
    """Interleaved RoPE of ``x`` [seq_len, hidden] (float32, CUDA) into ``out``; one pair per thread."""
    _launch("rope_f32_kernel", x, out, 2)


def rope_f32_v2(x: torch.Tensor, out: torch.Tensor) -> None:
    """As :func:`rope_f32` with one block per token and one thread per pair (hidden <= 2048)."""
    _launch("rope_f32_v2_kernel", x, out, 2, one_block_per_row=True)


def rope_f32x4_pack(x: torch.Tensor, out: torch.Tensor) -> None:
    """As :func:`rope_f32` with two pairs per thread through float4 loads (hidden % 4 == 0)."""
    _launch("rope_f32x4_pack_kernel", x, out, 4)


__all__ = ["rope_f32", "rope_f32_v2", "rope_f32x4_pack", "MODULE"]
