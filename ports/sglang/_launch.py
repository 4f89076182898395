"""Host checks and launches of the SGLang port: sgl-kernel's ``apply_rope_pos_ids_cos_sin_cache``
(``csrc/elementwise/rope.cu`` and ``BatchQKApplyRotaryPosIdsCosSinCacheEnhanced`` of
``pos_enc.cuh``) and ``rotary_embedding`` (``csrc/multimodal/rotary_embedding.cu``): the same
arguments, block shapes and grid choice.

Check order: the original's checks in its order, then the port's added checks (each refuses an
input the original would read or write out of bounds, or rotate wrongly without a word; see
:mod:`ports.sglang`), then the device.

Two added checks read device values on the host: the range of ``pos_ids`` (rows of
``cos_sin_cache``) and of ``kv_cache_loc`` (rows of ``k_buffer`` and ``v_buffer``). Each is a
device sync the original does not have (tens of microseconds: more than a decode step's kernel),
so each can be skipped for trusted indices (``check_positions_on_host`` /
``check_cache_loc_on_host``), and neither can run inside a CUDA-graph capture. Then the kernels'
own bounds apply: a position outside the cache gives its token NaN in the rotated lanes, a
``kv_cache_loc`` outside the buffers skips that token's store; neither reads or writes out of
bounds.
"""
from __future__ import annotations

import numpy as np
import torch

from ports import _cupy
from reference.vocabulary import check_dtype

HEAD_DIMS = (64, 128, 256, 512)  # FlashInfer's DISPATCH_HEAD_DIM
CACHE_TYPES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}  # ..._TO_CTYPE_FP16
ANY_HEAD_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
MIN_THREADS = 128  # num_threads = max(128, bdx)
ANY_HEAD_MAX_BLOCK = 512
MAX_GRID_Y = 65535
VECTOR_BYTES = 16  # a thread's x vector moves in 16-byte loads and stores


def vector_layout(head_dim: int, elem_bytes: int) -> tuple[int, int, int]:
    """``(vec_size, bdx, bdy)``: elements per thread, threads per head, tokens per block."""
    vec_size = max(16 // elem_bytes, head_dim // 32)
    bdx = head_dim // vec_size
    return vec_size, bdx, max(MIN_THREADS, bdx) // bdx


def use_head_parallel(nnz: int, bdy: int, blocks_per_sm: int, num_sms: int) -> bool:
    """The original's choice: the sequential-head grid when it has at least one full wave of
    blocks (occupancy x SMs), else one block per (token tile, head)."""
    return (nnz + bdy - 1) // bdy < blocks_per_sm * num_sms


def cache_kernel_name(head_parallel: bool, save_kv_cache: bool, interleave: bool,
                      head_dim: int, dtype: torch.dtype) -> str:
    """The instantiation the cache launcher picks (template arguments as the original's)."""
    vec, bdx, _ = vector_layout(head_dim, dtype.itemsize)
    kind = "sgl_rope_enhanced_head_parallel" if head_parallel else "sgl_rope_enhanced"
    flag = lambda b: "true" if b else "false"  # noqa: E731
    return (f"{kind}<{flag(save_kv_cache)}, {flag(interleave)}, {head_dim}, {vec}, {bdx}, "
            f"{CACHE_TYPES[dtype]}>")


def any_head_kernel_name(is_neox: bool, dtype: torch.dtype) -> str:
    return f"sgl_rotary_embedding<{ANY_HEAD_TYPES[dtype]}, {'true' if is_neox else 'false'}>"


def _kernel_names() -> tuple[str, ...]:
    flags = (False, True)
    names = [cache_kernel_name(hp, save, inter, head_dim, dtype) for dtype in CACHE_TYPES
             for head_dim in HEAD_DIMS for hp in flags for save in flags for inter in flags]
    names += [any_head_kernel_name(neox, dtype) for dtype in ANY_HEAD_TYPES for neox in flags]
    return tuple(names)


# sgl-kernel's sm_90 library: SGL_KERNEL_CUDA_FLAGS (-maxrregcount=128) plus -use_fast_math.
MODULE = _cupy.CudaModule("ports.sglang", "rope.cu", kernels=_kernel_names(),
                          options=("--use_fast_math", "--maxrregcount=128"))


def _check_last_dim_contiguous(t: torch.Tensor, name: str) -> None:
    if t.dim() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _check_dim(t: torch.Tensor, name: str, dim: int, what: str) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D ({what}), got shape {tuple(t.shape)}")


def _check_vector_access(t: torch.Tensor, name: str, vec_bytes: int) -> None:
    """Added: 16-byte vector loads need an aligned start and token/head strides in whole
    vectors (the original assumes it; a view with an odd offset faults)."""
    elem = t.element_size()
    if t.data_ptr() % vec_bytes or any((s * elem) % vec_bytes for s in t.stride()[:-1]):
        raise ValueError(f"{name} needs {vec_bytes}-byte aligned rows for vector loads: address "
                         f"{t.data_ptr():#x}, strides {t.stride()}")


def _capturing() -> bool:
    """Inside a CUDA-graph capture, where reading device values on the host is not allowed."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_index_range(idx: torch.Tensor, name: str, rows: int, what: str) -> None:
    """Every index within ``[0, rows)``: one reduction and one copy to the host (a sync)."""
    if idx.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(idx)).tolist())
    if lo < 0 or hi >= rows:
        raise ValueError(f"{name} must lie in [0, {rows}) ({what}); got values in [{lo}, {hi}] "
                         "(the original would read or write out of bounds)")


def check_positions(pos_ids: torch.Tensor, rows: int) -> None:
    """Added: every position indexes a row of the ``rows``-row cache (the original reads past
    the cache otherwise)."""
    _check_index_range(pos_ids, "pos_ids", rows, "rows of cos_sin_cache")


def check_cache_loc(kv_cache_loc: torch.Tensor, rows: int) -> None:
    """Added: every ``kv_cache_loc`` indexes one of the ``rows`` rows both KV buffers have (the
    original writes past them otherwise)."""
    _check_index_range(kv_cache_loc, "kv_cache_loc", rows, "rows of k_buffer and v_buffer")


def apply_rope_pos_ids_cos_sin_cache(q, k, q_rope, k_rope, cos_sin_cache, pos_ids,
                                     interleave: bool, enable_pdl: bool, v=None, k_buffer=None,
                                     v_buffer=None, kv_cache_loc=None, *,
                                     check_positions_on_host: bool = True,
                                     check_cache_loc_on_host: bool = True) -> None:
    """sgl-kernel's op: rotate ``q [nnz, Hq, D]`` and ``k [nnz, Hk, D]`` into ``q_rope`` and
    ``k_rope`` (which may be ``q`` and ``k``); with ``v`` given, also store k (rotated) and v at
    rows ``kv_cache_loc`` of ``k_buffer`` and ``v_buffer``. ``check_positions_on_host`` /
    ``check_cache_loc_on_host`` (added, keyword-only): :func:`check_positions` /
    :func:`check_cache_loc` first (each a sync the original does not have; skipped inside a
    CUDA-graph capture); False leaves the call the original's work, and the kernel's bounds
    apply."""
    named = [("q", q), ("k", k), ("q_rope", q_rope), ("k_rope", k_rope),
             ("cos_sin_cache", cos_sin_cache), ("pos_ids", pos_ids)]
    for name, t in named:
        _cupy.check_tensor(t, name)
    _check_last_dim_contiguous(q, "q")
    _check_last_dim_contiguous(k, "k")
    save_kv_cache = v is not None
    if save_kv_cache:
        for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer),
                        ("kv_cache_loc", kv_cache_loc)):
            if t is None:
                raise ValueError(f"the fused KV-cache store needs v, k_buffer, v_buffer and "
                                 f"kv_cache_loc; {name} is missing")
        for name, t in (("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
            _cupy.check_tensor(t, name)
            _check_last_dim_contiguous(t, name)
        _check_dim(k_buffer, "k_buffer", 3, "[rows, H_K, D]")
        _check_dim(v_buffer, "v_buffer", 3, "[rows, H_V, D]")
        _check_dim(v, "v", 3, "[nnz, H_V, D]")
        _check_dim(kv_cache_loc, "kv_cache_loc", 1, "[nnz]")
        _cupy.check_contiguous(kv_cache_loc, "kv_cache_loc")
    _cupy.check_contiguous(cos_sin_cache, "cos_sin_cache")
    _cupy.check_contiguous(pos_ids, "pos_ids")
    _check_dim(q, "q", 3, "[nnz, H_Q, D]")
    _check_dim(k, "k", 3, "[nnz, H_K, D]")
    _check_dim(cos_sin_cache, "cos_sin_cache", 2, "[max_seq_len, R]: cos in the first R/2, sin "
               "in the last R/2")
    if q.size(0) != k.size(0) or q.size(2) != k.size(2):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in nnz and head dim")
    if not save_kv_cache and enable_pdl:
        raise ValueError("enable_pdl needs the fused KV-cache path (the original's "
                         "TORCH_CHECK(!enable_pdl) on the FlashInfer branch)")
    if q.dtype not in CACHE_TYPES:
        raise TypeError(f"q has dtype {q.dtype}; sgl-kernel's dispatch takes float16 and bfloat16")
    rotary_dim, (nnz, num_qo_heads, head_dim), num_kv_heads = (
        cos_sin_cache.size(1), tuple(q.shape), k.size(1))
    # Added checks, each against an input the original mishandles.
    check_dtype(cos_sin_cache, "cos_sin_cache (the kernel reads float)", (torch.float32,))
    check_dtype(pos_ids, "pos_ids (the kernel reads int64)", (torch.int64,))
    for name, t in (("k", k), ("q_rope", q_rope), ("k_rope", k_rope),
                    *((("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer))
                      if save_kv_cache else ())):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, q has {q.dtype}: one dtype for all")
    for name, t, want in (("q_rope", q_rope, q.shape), ("k_rope", k_rope, k.shape)):
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"{name} must have shape {tuple(want)}, got {tuple(t.shape)}")
        _check_last_dim_contiguous(t, name)
    if head_dim not in HEAD_DIMS:
        raise NotImplementedError(
            f"head_dim {head_dim} is not one of {HEAD_DIMS} (FlashInfer's DISPATCH_HEAD_DIM); "
            "sgl-kernel's any-head-size kernel is ports.sglang.rotary_embedding")
    vec_size, bdx, bdy = vector_layout(head_dim, q.element_size())
    if rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"rotary dim {rotary_dim} (the cache's width) must be even and <= "
                         f"head_dim {head_dim}")
    step = vec_size if interleave else 2 * vec_size
    if rotary_dim % step:
        raise NotImplementedError(
            f"rotary dim {rotary_dim} must be a multiple of {step} here: a thread rotates "
            f"{vec_size} elements{'' if interleave else ' with partners R/2 away'}, and the "
            "original rotates a vector straddling R or R/2 with the wrong partner or angle")
    if pos_ids.dim() != 1 or pos_ids.numel() != nnz:
        raise ValueError(f"pos_ids must be [nnz] = [{nnz}], got shape {tuple(pos_ids.shape)}")
    for name, t in (("q", q), ("k", k), ("q_rope", q_rope), ("k_rope", k_rope),
                    *((("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer))
                      if save_kv_cache else ())):
        _check_vector_access(t, name, VECTOR_BYTES)
    if cos_sin_cache.data_ptr() % 16:
        raise ValueError("cos_sin_cache must be 16-byte aligned (float4 loads)")
    if save_kv_cache:
        if v.size(0) != nnz or v.size(1) != num_kv_heads or v.size(2) != head_dim:
            raise ValueError(f"v must be [nnz, H_K, D] = {(nnz, num_kv_heads, head_dim)}, got "
                             f"{tuple(v.shape)} (the kernel reads it with k's head count)")
        for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
            if t.size(1) != num_kv_heads or t.size(2) != head_dim:
                raise ValueError(f"{name} must be [rows, {num_kv_heads}, {head_dim}], got "
                                 f"{tuple(t.shape)}")
        check_dtype(kv_cache_loc, "kv_cache_loc (the kernel reads int64)", (torch.int64,))
        if kv_cache_loc.numel() != nnz:
            raise ValueError(f"kv_cache_loc must have nnz = {nnz} entries, got "
                             f"{kv_cache_loc.numel()}")
    kv_rows = min(k_buffer.size(0), v_buffer.size(0)) if save_kv_cache else 0
    if save_kv_cache and check_cache_loc_on_host and not _capturing():
        check_cache_loc(kv_cache_loc, kv_rows)
    if check_positions_on_host and not _capturing():
        check_positions(pos_ids, cos_sin_cache.size(0))
    if num_qo_heads + num_kv_heads > MAX_GRID_Y:
        raise ValueError(f"{num_qo_heads + num_kv_heads} heads exceed the grid's y limit")
    extra = (("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer),
             ("kv_cache_loc", kv_cache_loc)) if save_kv_cache else ()
    device = _cupy.check_cuda(*named, *extra)
    if nnz == 0:
        return

    sequential = cache_kernel_name(False, save_kv_cache, interleave, head_dim, q.dtype)
    num_threads = bdx * bdy
    blocks_per_sm = occupancy(sequential, device, num_threads)
    nblks_x = (nnz + bdy - 1) // bdy
    strides = lambda t: (t.stride(0), t.stride(1)) if t is not None else (0, 0)  # noqa: E731
    args = (_cupy.ptr(q), _cupy.ptr(k), _cupy.ptr(v), _cupy.ptr(q_rope), _cupy.ptr(k_rope),
            _cupy.ptr(k_buffer), _cupy.ptr(v_buffer), _cupy.ptr(cos_sin_cache),
            _cupy.ptr(pos_ids), _cupy.i64(cos_sin_cache.size(0)), _cupy.i32(nnz),
            _cupy.i32(num_qo_heads), _cupy.i32(num_kv_heads), _cupy.i32(rotary_dim),
            *(np.uint64(s) for t in (q, k, v, q_rope, k_rope, k_buffer, v_buffer)
              for s in strides(t)),
            _cupy.ptr(kv_cache_loc), _cupy.i64(kv_rows))
    if use_head_parallel(nnz, bdy, blocks_per_sm, num_sms(device)):
        _cupy.launch(MODULE, cache_kernel_name(True, save_kv_cache, interleave, head_dim, q.dtype),
                     device,
                     (nblks_x, num_qo_heads + num_kv_heads), (bdx, bdy), args)
    else:
        _cupy.launch(MODULE, sequential, device, (nblks_x,), (bdx, bdy), args)


def occupancy(name: str, device: int, threads: int) -> int:
    """cudaOccupancyMaxActiveBlocksPerMultiprocessor for kernel ``name`` (no shared memory)."""
    from cupy.cuda import driver

    fn = MODULE.function(name, device)
    return driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, threads, 0)


def num_sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def rotary_embedding(cos: torch.Tensor, sin: torch.Tensor, query: torch.Tensor,
                     key: torch.Tensor | None, head_size: int, is_neox: bool) -> None:
    """sgl-kernel's ``rotary_embedding`` (any head size), in place on ``query`` and ``key``
    (``[T, H * D]`` or ``[T, H, D]``, contiguous) with per-token ``cos``/``sin`` ``[T, D_cos]``:
    ``is_neox`` True pairs (2i, 2i+1) with ``D_cos = R/2``; False pairs (i, i + R/2) with
    ``D_cos = R``."""
    for name, t in (("cos", cos), ("sin", sin), ("query", query)):
        _cupy.check_tensor(t, name)
    if query.dim() not in (2, 3):
        raise ValueError("query must be in shape [num_tokens, hidden_size] or [num_tokens, "
                         f"num_heads, head_size], got {tuple(query.shape)}")
    if key is not None:
        _cupy.check_tensor(key, "key")
        if key.dim() not in (2, 3):
            raise ValueError("key must be in shape [num_tokens, hidden_size] or [num_tokens, "
                             f"num_kv_heads, head_size], got {tuple(key.shape)}")
    num_tokens = query.size(0)
    if cos.dim() != 2 or sin.dim() != 2:
        raise ValueError(f"cos and sin must be [num_tokens, D_cos], got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    if cos.size(0) != num_tokens or sin.size(0) != num_tokens:
        raise ValueError(f"cos/sin have {cos.size(0)}/{sin.size(0)} rows for {num_tokens} tokens")
    if cos.size(1) != sin.size(1):
        raise ValueError("cos and sin D_cos/D_sin mismatch")
    if cos.dtype != query.dtype or sin.dtype != query.dtype:
        raise TypeError(f"cos/sin dtype {cos.dtype}/{sin.dtype} must be query's {query.dtype}")
    if not query.is_contiguous():
        raise ValueError("query must be contiguous; got non-contiguous tensor")
    if key is not None:
        if key.dtype != query.dtype:
            raise TypeError(f"key dtype {key.dtype} must be query's {query.dtype}")
        if not key.is_contiguous():
            raise ValueError("key must be contiguous when provided; got non-contiguous tensor")
    if head_size < 1:
        raise ValueError(f"head_size must be positive, got {head_size}")
    q_hidden = query.size(1) if query.dim() == 2 else query.size(1) * query.size(2)
    if query.dim() == 3 and query.size(2) != head_size:
        raise ValueError("Query head_size mismatch in 3D tensor")
    if q_hidden % head_size:
        raise ValueError(f"query_hidden_size {q_hidden} not divisible by head_size {head_size}")
    num_heads = q_hidden // head_size
    k_hidden, num_kv_heads = 0, num_heads
    if key is not None:
        if key.size(0) != num_tokens:
            raise ValueError("Key num_tokens mismatch")
        k_hidden = key.size(1) if key.dim() == 2 else key.size(1) * key.size(2)
        if key.dim() == 3 and key.size(2) != head_size:
            raise ValueError("Key head_size mismatch in 3D tensor")
        if k_hidden % head_size:
            raise ValueError(f"key_hidden_size {k_hidden} not divisible by head_size {head_size}")
        num_kv_heads = k_hidden // head_size
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be divisible by num_kv_heads {num_kv_heads}")
    if query.dtype not in ANY_HEAD_TYPES:
        raise TypeError(f"query has dtype {query.dtype}; this port takes float32, float16, "
                        "bfloat16 (the original's float64 instantiation is not ported)")
    rot_dim_arg = cos.size(1)
    # Added: the rotated width must fit the head (the original reads and writes past each head,
    # into the next head or past the tensor), and the tables must be dense rows.
    rotary = 2 * rot_dim_arg if is_neox else rot_dim_arg
    if rot_dim_arg < 1 or rotary > head_size or (not is_neox and rot_dim_arg % 2):
        raise ValueError(f"cos/sin width {rot_dim_arg} gives a rotated width {rotary} that must "
                         f"be even and <= head_size {head_size} ("
                         f"{'R/2' if is_neox else 'R'} values per row with is_neox={is_neox})")
    _cupy.check_contiguous(cos, "cos")
    _cupy.check_contiguous(sin, "sin")
    # Added: the original forms token offsets in int32 (token_idx * stride).
    _cupy.check_index_fits(query.numel(), "query's element count (int32 token offsets)")
    if key is not None:
        _cupy.check_index_fits(key.numel(), "key's element count (int32 token offsets)")
    _cupy.check_index_fits(cos.numel(), "cos's element count (int32 row offsets)")
    device = _cupy.check_cuda(("cos", cos), ("sin", sin), ("query", query),
                              *((("key", key),) if key is not None else ()))
    if num_tokens == 0:
        return
    embed = rot_dim_arg if is_neox else rot_dim_arg // 2
    block = min(max(num_heads * embed, num_kv_heads * embed), ANY_HEAD_MAX_BLOCK) or 1
    # head strides: query.stride(1) for [T, H, D], else head_size (dense either way here)
    head_stride_q = query.stride(1) if query.dim() == 3 else head_size
    head_stride_k = (key.stride(1) if key is not None and key.dim() == 3 else head_size)
    _cupy.launch(MODULE, any_head_kernel_name(is_neox, query.dtype), device, (num_tokens,), (block,),
                 (_cupy.ptr(cos), _cupy.ptr(sin), _cupy.ptr(query), _cupy.ptr(key),
                  _cupy.i32(rot_dim_arg), _cupy.i64(q_hidden), _cupy.i64(k_hidden),
                  _cupy.i64(head_stride_q), _cupy.i64(head_stride_k), _cupy.i32(num_heads),
                  _cupy.i32(num_kv_heads), _cupy.i32(head_size)))


__all__ = ["MODULE", "HEAD_DIMS", "vector_layout", "use_head_parallel", "cache_kernel_name",
           "any_head_kernel_name", "check_positions", "check_cache_loc",
           "apply_rope_pos_ids_cos_sin_cache", "rotary_embedding"]
