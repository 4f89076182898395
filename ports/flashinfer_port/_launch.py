"""Host checks, launch shape and CuPy launch of the FlashInfer port: ``csrc/rope.cu``'s bindings
and ``pos_enc.cuh``'s launchers (``BatchQKApplyRotary``, ``BatchQKApplyRotaryPosIds``,
``BatchQKApplyRotaryPosIdsCosSinCache`` and the Llama 3.1 variants): the same block shape, the
same strategy choice, the same fp32 parameters.

Launch shape (every path): ``vec_size = max(16 / sizeof(DType), head_dim / 32)``,
``bdx = head_dim / vec_size``, ``bdy = max(128, bdx) / bdx``, block ``(bdx, bdy)``.

* indptr + offsets: grid ``(batch_size * (num_qo_heads + num_kv_heads))``, one block per
  (segment, head).
* pos_ids and the cos/sin cache: ``nblks_x = ceil(nnz / bdy)``; the sequential-head kernel
  (grid ``(nblks_x)``) when ``nblks_x`` is at least the resident blocks of the whole GPU
  (``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` x SMs), else the head-parallel kernel (grid
  ``(nblks_x, num_qo_heads + num_kv_heads)``): :func:`choose_strategy`. The Llama 3.1 pos_ids
  path always takes the sequential kernel, as the original's launcher does.

Check order: the original's checks, then the port's added checks (each refuses an input the
original would read or write out of bounds, misalign, or silently get wrong; see
:mod:`ports.flashinfer_port`), then the device.
"""
from __future__ import annotations

import functools
import math
from typing import Literal

import numpy as np
import torch

from ports import _cupy
from reference.vocabulary import check_dtype, check_rank

HEAD_DIMS = (64, 128, 256, 512)  # DISPATCH_HEAD_DIM
DTYPE_NAMES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}  # ..._FP16 dispatch
ID_NAMES = {torch.int32: "int", torch.int64: "long long"}  # DISPATCH_DLPACK_IDTYPE_TO_CTYPE
UINT32_MAX = 2**32 - 1
MAX_GRID_Y = 65535
MAX_GRID_X = 2**31 - 1
# FlashInfer's JIT compiles csrc/rope.cu with -use_fast_math (flashinfer/jit/core.py).
OPTIONS = ("--use_fast_math",)

Strategy = Literal["sequential", "head_parallel"]


def vector_layout(head_dim: int, itemsize: int) -> tuple[int, int, int]:
    """``(vec_size, bdx, bdy)``: elements per thread, threads per head, tokens per block."""
    vec_size = max(16 // itemsize, head_dim // 32)
    bdx = head_dim // vec_size
    bdy = max(128, bdx) // bdx
    return vec_size, bdx, bdy


def choose_strategy(nblks_x: int, blocks_per_sm: int, num_sms: int) -> Strategy:
    """FlashInfer's choice: sequential heads once the token blocks alone fill every SM's resident
    slots (``nblks_x >= blocks_per_sm * num_sms``), else one block per (token tile, head)."""
    return "sequential" if nblks_x >= blocks_per_sm * num_sms else "head_parallel"


def _kernel(kind: str, interleave: bool, head_dim: int, dtype: str, idtype: str) -> str:
    vec_size, bdx, _ = vector_layout(head_dim, 2)
    flag = "true" if interleave else "false"
    return f"{kind}<{flag}, {head_dim}, {vec_size}, {bdx}, {dtype}, {idtype}>"


def _names(*kinds: str) -> tuple[str, ...]:
    return tuple(_kernel(kind, il, hd, t, i) for kind in kinds for il in (False, True)
                 for hd in HEAD_DIMS for t in DTYPE_NAMES.values() for i in ID_NAMES.values())


# One module per launcher family, so a first call compiles only the family it uses.
INDPTR_MODULE = _cupy.CudaModule("ports.flashinfer_port", "pos_enc.cu",
                                 kernels=_names("fi_indptr"), options=OPTIONS)
POS_IDS_MODULE = _cupy.CudaModule("ports.flashinfer_port", "pos_enc.cu",
                                  kernels=_names("fi_pos_ids", "fi_pos_ids_head_parallel"),
                                  options=OPTIONS)
CACHE_MODULE = _cupy.CudaModule("ports.flashinfer_port", "pos_enc.cu",
                                kernels=_names("fi_cos_sin_cache",
                                               "fi_cos_sin_cache_head_parallel"),
                                options=OPTIONS)


# ---- fp32 parameters, as the launchers compute them -------------------------------------------
def rope_parameters(rope_scale: float, rope_theta: float, low_freq_factor: float | None = None,
                    high_freq_factor: float | None = None, old_context_len: float | None = None
                    ) -> tuple[np.float32, np.float32, np.float32, np.float32]:
    """``(smooth_a, smooth_b, rope_rcp_scale, rope_rcp_theta)`` as the launchers compute them:
    the doubles from Python narrowed to float, ``1.0f / x`` in fp32, ``smooth_a`` in double
    (``M_PI`` is a double) then narrowed, ``smooth_b`` in fp32. Plain RoPE has ``a = b = 0``."""
    scale, theta = np.float32(rope_scale), np.float32(rope_theta)
    if not (math.isfinite(rope_scale) and rope_scale > 0):
        raise ValueError(f"rope_scale must be positive and finite, got {rope_scale}")
    if not (math.isfinite(rope_theta) and rope_theta > 0):
        raise ValueError(f"rope_theta must be positive and finite, got {rope_theta}")
    rcp_scale, rcp_theta = np.float32(1.0) / scale, np.float32(1.0) / theta
    if low_freq_factor is None:
        return np.float32(0.0), np.float32(0.0), rcp_scale, rcp_theta
    low, high = np.float32(low_freq_factor), np.float32(high_freq_factor)
    old = np.float32(old_context_len)
    # Added: the original divides by (high - low) and by low, giving inf/NaN frequencies.
    if not (low > 0 and high > low and old > 0):
        raise ValueError("Llama 3.1 scaling needs 0 < low_freq_factor < high_freq_factor and "
                         f"old_context_len > 0, got {low_freq_factor}, {high_freq_factor}, "
                         f"{old_context_len}")
    smooth_a = np.float32(float(old) / (2 * math.pi * float(high) - 2 * math.pi * float(low)))
    with np.errstate(all="ignore"):
        smooth_b = np.float32(-1.0) / (high / low - np.float32(1.0))
    return smooth_a, smooth_b, rcp_scale, rcp_theta


# ---- host checks ------------------------------------------------------------------------------
def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int]:
    """The bindings' checks on q and k, then the port's; returns ``(nnz, Hq, Hk, head_dim)``."""
    for name, t in (("q", q), ("k", k)):
        _cupy.check_tensor(t, name)
        check_rank(t, name, 3, "nnz, heads, head_dim")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous (stride 1), got strides "
                             f"{t.stride()}")
        check_dtype(t, name, DTYPE_NAMES)
    if q.size(0) != k.size(0):
        raise ValueError(f"q and k must have the same token count, got {q.size(0)} and {k.size(0)}")
    if q.size(2) != k.size(2):
        raise ValueError(f"q and k must have the same head_dim, got {q.size(2)} and {k.size(2)}")
    # Added: the original dispatches on q's dtype and reinterprets k's memory as that type.
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must have one dtype, got {q.dtype} and {k.dtype}")
    head_dim = q.size(2)
    if head_dim not in HEAD_DIMS:
        raise NotImplementedError(f"head_dim {head_dim} is not one the kernels are built for "
                                  f"({', '.join(map(str, HEAD_DIMS))}; DISPATCH_HEAD_DIM)")
    nnz = q.size(0)
    if nnz > UINT32_MAX:
        raise NotImplementedError(f"{nnz} tokens overflow the original's uint32 token index")
    return nnz, q.size(1), k.size(1), head_dim


def _check_vectors(tensors: dict[str, torch.Tensor], vec_bytes: int = 16, outer: int = 2) -> None:
    """Added: the kernels move each thread's vector with 16-byte loads and stores, so every
    base address and the ``outer`` leading strides (token and head; a cache's row) must be
    16-byte aligned (the original faults)."""
    for name, t in tensors.items():
        item = t.element_size()
        if t.data_ptr() % vec_bytes or any((s * item) % vec_bytes for s in t.stride()[:outer]):
            raise ValueError(f"{name} must be {vec_bytes}-byte aligned with token and head strides "
                             f"in multiples of {vec_bytes // item} elements (the kernel's vector "
                             f"loads); got address {t.data_ptr():#x}, strides {t.stride()}")


def _check_rotary_dim(rotary_dim, head_dim: int, vec_size: int, interleave: bool) -> None:
    if not isinstance(rotary_dim, (int, np.integer)) or isinstance(rotary_dim, bool):
        raise TypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")
    # Added: the original reads partners past the head when rotary_dim > head_dim, and rotates
    # whole vectors, pairing lanes across the rotary boundary unless it splits at a vector.
    if not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be in (0, head_dim = {head_dim}], got {rotary_dim}")
    step = vec_size if interleave else 2 * vec_size
    if rotary_dim % step:
        raise ValueError(f"rotary_dim {rotary_dim} must be a multiple of {step} here: each thread "
                         f"rotates a whole vector of {vec_size} elements"
                         + ("" if interleave else " and its partner vector sits R/2 away"))


def check_row_offset(rows: int, rotary_dim: int, pos_dtype: torch.dtype) -> None:
    """Added: int32 positions form the cache row offset ``pos * rotary_dim`` in 32 bits
    (unsigned); the last row's, ``(rows - 1) * rotary_dim``, must fit."""
    if pos_dtype == torch.int32 and (rows - 1) * rotary_dim > UINT32_MAX:
        raise NotImplementedError(f"a {rows} x {rotary_dim} cache overflows the 32-bit row offset "
                                  "of int32 positions; pass int64 positions")


def _check_index(t: torch.Tensor, name: str, count: int | None = None) -> None:
    _cupy.check_tensor(t, name)
    check_rank(t, name, 1)
    check_dtype(t, name, ID_NAMES)
    _cupy.check_contiguous(t, name)
    # Added: the original reads count entries whatever the tensor's length.
    if count is not None and t.numel() != count:
        raise ValueError(f"{name} must have {count} entries (one per token), got {t.numel()}")


# The two checks that read device values on the host. Each is a device sync the original does
# not have (tens of microseconds: more than a decode step's kernel), so each launcher takes a flag
# to skip it for trusted indices. Skipped, or inside a CUDA-graph capture (where no value can be
# read), the kernels' own bounds apply: a position outside the cache gets NaN cos/sin, a segment
# outside [0, nnz] is left unwritten; neither reads or writes out of bounds.
def check_positions(pos_ids: torch.Tensor, rows: int) -> None:
    """Added: every position indexes a cache row (the original reads past the cache otherwise).
    One reduction and a copy to the host."""
    if pos_ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(pos_ids)).tolist())
    if lo < 0 or hi >= rows:
        raise ValueError(f"positions span [{lo}, {hi}] but cos_sin_cache has {rows} rows "
                         f"(valid positions are 0..{rows - 1})")


def check_indptr(indptr: torch.Tensor, nnz: int) -> None:
    """Added: ``indptr`` rises within ``[0, nnz]`` (the original trusts it: a decreasing or
    out-of-range entry reads and writes tokens outside q and k). One copy to the host."""
    bounds = indptr.tolist()
    if any(lo > hi for lo, hi in zip(bounds, bounds[1:])) or bounds[0] < 0 or bounds[-1] > nnz:
        raise ValueError(f"indptr must rise within [0, nnz = {nnz}], got {bounds}")


def _device(*named: tuple[str, torch.Tensor]) -> int:
    return _cupy.check_cuda(*named)


@functools.lru_cache(maxsize=None)
def device_occupancy(module: _cupy.CudaModule, name: str, device: int, threads: int
                     ) -> tuple[int, int]:
    """``(blocks_per_sm, num_sms)``: ``cudaOccupancyMaxActiveBlocksPerMultiprocessor(kernel,
    threads, 0)`` for the sequential kernel, and the device's SM count (cached per kernel)."""
    from cupy_backends.cuda.api import driver

    fn = module.function(name, device)
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, threads, 0)
    return per_sm, torch.cuda.get_device_properties(device).multi_processor_count


def _strides(q, k, q_rope, k_rope) -> tuple:
    return tuple(np.uint64(s) for t in (q, k, q_rope, k_rope) for s in t.stride()[:2])


# ---- the launchers ----------------------------------------------------------------------------
def batch_qk_apply_rotary(q, k, q_rope, k_rope, indptr, offsets, rotary_dim: int,
                          interleave: bool, params: tuple, *, check_indptr_on_host: bool = True
                          ) -> None:
    """``apply_rope`` / ``apply_llama31_rope`` (binding and ``BatchQKApplyRotary``).
    ``check_indptr_on_host``: :func:`check_indptr` first (a sync the original does not have)."""
    nnz, hq, hk, head_dim = _check_qk(q, k)
    _check_index(indptr, "indptr")
    _check_index(offsets, "offsets")
    batch_size = offsets.numel()
    if indptr.numel() != batch_size + 1:
        raise ValueError(f"indptr must have batch_size + 1 = {batch_size + 1} entries, got "
                         f"{indptr.numel()}")
    if indptr.dtype != offsets.dtype:
        raise TypeError(f"indptr and offsets must have one dtype, got {indptr.dtype} and "
                        f"{offsets.dtype}")
    vec_size, bdx, bdy = vector_layout(head_dim, q.element_size())
    _check_rotary_dim(rotary_dim, head_dim, vec_size, interleave)
    _check_vectors({"q": q, "k": k, "q_rope": q_rope, "k_rope": k_rope})
    if check_indptr_on_host and not _capturing():
        check_indptr(indptr, nnz)
    if batch_size * (hq + hk) > MAX_GRID_X:
        raise ValueError(f"batch_size x heads = {batch_size * (hq + hk)} exceeds the grid limit")
    device = _device(("q", q), ("k", k), ("indptr", indptr), ("offsets", offsets))
    if batch_size == 0 or hq + hk == 0 or nnz == 0:
        return
    name = _kernel("fi_indptr", interleave, head_dim, DTYPE_NAMES[q.dtype], ID_NAMES[indptr.dtype])
    _cupy.launch(INDPTR_MODULE, name, device, (batch_size * (hq + hk),), (bdx, bdy, 1),
                 (_cupy.ptr(q), _cupy.ptr(k), _cupy.ptr(q_rope), _cupy.ptr(k_rope),
                  _cupy.ptr(indptr), _cupy.ptr(offsets), np.uint32(nnz), np.uint32(batch_size),
                  np.uint32(hq),
                  np.uint32(hk), np.uint32(rotary_dim), *_strides(q, k, q_rope, k_rope), *params))


def _pos_ids_launch(module, kinds: tuple[str, str], q, k, q_rope, k_rope, head_args: tuple,
                    pos_ids, pos_args: tuple, interleave: bool, rotary_dim: int, tail_args: tuple,
                    always_sequential: bool, device: int, strategy: Strategy | None) -> Strategy:
    nnz, hq, hk, head_dim = q.size(0), q.size(1), k.size(1), q.size(2)
    _, bdx, bdy = vector_layout(head_dim, q.element_size())
    nblks_x = (nnz + bdy - 1) // bdy
    seq = _kernel(kinds[0], interleave, head_dim, DTYPE_NAMES[q.dtype], ID_NAMES[pos_ids.dtype])
    if strategy is None:
        strategy = ("sequential" if always_sequential else
                    choose_strategy(nblks_x, *device_occupancy(module, seq, device, bdx * bdy)))
    if strategy == "head_parallel" and hq + hk > MAX_GRID_Y:
        raise ValueError(f"{hq + hk} heads exceed the head-parallel grid's y limit {MAX_GRID_Y}")
    if nnz == 0 or hq + hk == 0:
        return strategy
    args = (_cupy.ptr(q), _cupy.ptr(k), _cupy.ptr(q_rope), _cupy.ptr(k_rope), *head_args,
            _cupy.ptr(pos_ids), *pos_args, np.uint32(nnz), np.uint32(hq), np.uint32(hk),
            np.uint32(rotary_dim), *_strides(q, k, q_rope, k_rope), *tail_args)
    if strategy == "sequential":
        _cupy.launch(module, seq, device, (nblks_x,), (bdx, bdy, 1), args)
    else:
        par = _kernel(kinds[1], interleave, head_dim, DTYPE_NAMES[q.dtype], ID_NAMES[pos_ids.dtype])
        _cupy.launch(module, par, device, (nblks_x, hq + hk), (bdx, bdy, 1), args)
    return strategy


def batch_qk_apply_rotary_pos_ids(q, k, q_rope, k_rope, pos_ids, rotary_dim: int,
                                  interleave: bool, params: tuple, *, llama31: bool = False,
                                  strategy: Strategy | None = None) -> Strategy:
    """``apply_rope_pos_ids`` / ``apply_llama31_rope_pos_ids``; returns the strategy taken.
    ``strategy`` forces one kernel (tests run both on one input)."""
    nnz, _, _, head_dim = _check_qk(q, k)
    _check_index(pos_ids, "pos_ids", nnz)
    vec_size, _, _ = vector_layout(head_dim, q.element_size())
    _check_rotary_dim(rotary_dim, head_dim, vec_size, interleave)
    _check_vectors({"q": q, "k": k, "q_rope": q_rope, "k_rope": k_rope})
    device = _device(("q", q), ("k", k), ("pos_ids", pos_ids))
    return _pos_ids_launch(POS_IDS_MODULE, ("fi_pos_ids", "fi_pos_ids_head_parallel"), q, k,
                           q_rope, k_rope, (), pos_ids, (), interleave, rotary_dim, params,
                           llama31, device, strategy)


def batch_qk_apply_rotary_cos_sin_cache(q, k, q_rope, k_rope, cos_sin_cache, pos_ids,
                                        interleave: bool, *, strategy: Strategy | None = None,
                                        check_positions_on_host: bool = True) -> Strategy:
    """``apply_rope_with_cos_sin_cache`` (``BatchQKApplyRotaryPosIdsCosSinCache``); returns the
    strategy taken. ``check_positions_on_host``: :func:`check_positions` first (a sync the
    original does not have)."""
    nnz, _, _, head_dim = _check_qk(q, k)
    _cupy.check_tensor(cos_sin_cache, "cos_sin_cache")
    _check_index(pos_ids, "positions", nnz)
    check_rank(cos_sin_cache, "cos_sin_cache", 2, "max_position, rotary_dim")
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    _cupy.check_contiguous(cos_sin_cache, "cos_sin_cache")
    rows, rotary_dim = cos_sin_cache.shape
    vec_size, _, _ = vector_layout(head_dim, q.element_size())
    if head_dim < rotary_dim:
        raise ValueError(f"head_dim ({head_dim}) must be >= rotary_dim ({rotary_dim})")
    _check_rotary_dim(rotary_dim, head_dim, vec_size, interleave)
    _check_vectors({"q": q, "k": k, "q_rope": q_rope, "k_rope": k_rope})
    _check_vectors({"cos_sin_cache": cos_sin_cache}, outer=1)
    check_row_offset(rows, rotary_dim, pos_ids.dtype)
    if rows > UINT32_MAX:
        raise NotImplementedError(f"a cache of {rows} rows overflows the kernel's uint32 row bound")
    if check_positions_on_host and not _capturing():
        check_positions(pos_ids, rows)
    device = _device(("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache), ("positions", pos_ids))
    return _pos_ids_launch(CACHE_MODULE, ("fi_cos_sin_cache", "fi_cos_sin_cache_head_parallel"),
                           q, k, q_rope, k_rope, (_cupy.ptr(cos_sin_cache),), pos_ids,
                           (np.uint32(rows),), interleave, rotary_dim, (), False, device,
                           strategy)


__all__ = ["HEAD_DIMS", "INDPTR_MODULE", "POS_IDS_MODULE", "CACHE_MODULE", "vector_layout",
           "choose_strategy", "device_occupancy", "rope_parameters", "check_positions",
           "check_indptr", "batch_qk_apply_rotary",
           "batch_qk_apply_rotary_pos_ids", "batch_qk_apply_rotary_cos_sin_cache"]
