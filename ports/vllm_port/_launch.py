"""Host checks and launch of the vLLM port: the host function ``rotary_embedding`` of
``csrc/pos_encoding_kernels.cu`` (its checks in its order, its stride and head-stride choice, its
grid and block), then the port's added checks (each refuses an input the original would read or
write out of bounds, or rotate wrongly; see :mod:`ports.vllm_port`), then the device.
"""
from __future__ import annotations

import torch

from ports import _cupy
from reference.vocabulary import KERNEL_TORCH_DTYPES, check_dtype

MAX_THREADS = 512  # the original's block cap
KERNEL_TYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}


def kernel_name(query_dtype: torch.dtype, cache_dtype: torch.dtype, is_neox: bool) -> str:
    return (f"rotary_embedding_kernel<{KERNEL_TYPE[query_dtype]}, {KERNEL_TYPE[cache_dtype]}, "
            f"{'true' if is_neox else 'false'}>")


# Every (query dtype, cache dtype, convention) the original's two nested dispatches instantiate.
MODULE = _cupy.CudaModule(
    "ports.vllm_port", "pos_encoding_kernels.cu", options=(),
    kernels=tuple(kernel_name(q, c, n) for q in KERNEL_TYPE for c in KERNEL_TYPE
                  for n in (True, False)))


def block_size(num_heads: int, rot_dim: int) -> int:
    """The original's block: one thread per (query head, pair), at most 512 threads."""
    return min(num_heads * rot_dim // 2, MAX_THREADS)


def _capturing() -> bool:
    """Inside a CUDA-graph capture, where reading device values on the host is not allowed."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_positions(positions: torch.Tensor, max_position: int) -> None:
    """Added: every position indexes a cache row (the original reads past the cache otherwise).
    Reads the positions on the host: one reduction and a device sync."""
    if positions.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(positions)).tolist()  # one copy to the host
    if lo < 0 or hi >= max_position:
        raise ValueError(f"positions span [{lo}, {hi}] but cos_sin_cache has {max_position} rows "
                         f"(valid positions are 0..{max_position - 1}); the original would read "
                         "past the cache")


def _layout(t: torch.Tensor, name: str, positions_ndim: int, head_size: int, num_tokens: int
            ) -> tuple[int, int]:
    """(hidden size, head stride) of query or key, refusing what the kernel would mis-index."""
    if t.dim() not in (positions_ndim + 1, positions_ndim + 2):
        raise ValueError(f"{name} must be [*tokens, heads * head_size] or [*tokens, heads, "
                         f"head_size] with the positions' {positions_ndim} token dims; got shape "
                         f"{tuple(t.shape)}")
    if t.stride(-1) != 1 and t.size(-1) > 1:
        raise ValueError(f"{name}'s last dim must be contiguous (the kernel steps 1 element per "
                         f"channel); got strides {t.stride()}")
    if t.dim() == positions_ndim + 1 and t.size(-1) % head_size:
        raise ValueError(f"{name}'s hidden size {t.size(-1)} is not a multiple of head_size "
                         f"{head_size}")
    if t.dim() == positions_ndim + 2 and t.size(-1) != head_size:
        raise ValueError(f"{name} is [*tokens, heads, {t.size(-1)}] but head_size is {head_size}")
    if positions_ndim == 2 and t.size(0) > 1 and t.stride(0) != t.size(1) * t.stride(1):
        # The kernel walks token_idx = b * s + i with the seq stride alone.
        raise ValueError(f"{name} [b, s, ...] needs batch stride = s x seq stride (the kernel "
                         f"indexes tokens b * s + i with the seq stride); got strides {t.stride()}"
                         "; flatten b and s or pass a dense tensor")
    hidden = t.numel() // num_tokens
    head_stride = t.stride(-2) if t.dim() == positions_ndim + 2 else head_size
    return hidden, head_stride


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool,
                     rope_dim_offset: int = 0, inverse: bool = False, *,
                     check_positions_on_host: bool = True) -> None:
    """Rotate ``query`` (and ``key``) in place; see :func:`ports.vllm_port.rotary_embedding`."""
    for name, t in (("positions", positions), ("query", query), ("cos_sin_cache", cos_sin_cache),
                    *((("key", key),) if key is not None else ())):
        _cupy.check_tensor(t, name)
    # The original's checks, in its order.
    if positions.dim() not in (1, 2):
        raise ValueError("positions must have shape [num_tokens] or [batch_size, seq_len], got "
                         f"{tuple(positions.shape)}")
    pdim = positions.dim()
    if query.dim() < pdim or (key is not None and key.dim() < pdim) \
            or query.shape[:pdim] != positions.shape \
            or (key is not None and key.shape[:pdim] != positions.shape):
        raise ValueError("query, key and positions must have the same "
                         + ("number of tokens" if pdim == 1 else "batch_size and seq_len")
                         + f": positions {tuple(positions.shape)}, query {tuple(query.shape)}"
                         + (f", key {tuple(key.shape)}" if key is not None else ""))
    if not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    if not isinstance(rope_dim_offset, int) or rope_dim_offset < 0:
        raise ValueError(f"rope_dim_offset must be an int >= 0, got {rope_dim_offset!r}")
    # Added, before any division by the token count (the original divides by it).
    num_tokens = positions.numel()
    check_dtype(positions, "positions (the kernel reads int64)", (torch.int64,))
    if query.dtype not in KERNEL_TORCH_DTYPES:
        raise TypeError(f"query has dtype {query.dtype}; the original dispatches float32, "
                        "float16, bfloat16")
    if key is not None and key.dtype != query.dtype:
        raise TypeError(f"key has dtype {key.dtype} but query has {query.dtype} (the kernel "
                        "reads both as query's type)")
    if cos_sin_cache.dtype not in KERNEL_TORCH_DTYPES:
        raise TypeError(f"cos_sin_cache has dtype {cos_sin_cache.dtype}; the original dispatches "
                        "float32, float16, bfloat16")
    if cos_sin_cache.dim() != 2:
        raise ValueError("cos_sin_cache must be [max_position, rot_dim], got shape "
                         f"{tuple(cos_sin_cache.shape)}")
    if num_tokens == 0:
        return
    q_hidden, head_stride = _layout(query, "query", pdim, head_size, num_tokens)
    k_hidden, k_head_stride = (_layout(key, "key", pdim, head_size, num_tokens)
                               if key is not None else (0, head_stride))
    num_heads = q_hidden // head_size
    num_kv_heads = k_hidden // head_size if key is not None else num_heads
    if key is not None and num_kv_heads == 0:
        raise ValueError("key has no heads (the original divides by num_kv_heads)")
    if num_kv_heads and num_heads % num_kv_heads:
        raise ValueError(f"query's {num_heads} heads are not a multiple of key's {num_kv_heads}")
    rot_dim = cos_sin_cache.size(1)
    seq_dim = pdim - 1
    query_stride = query.stride(seq_dim)
    key_stride = key.stride(seq_dim) if key is not None else 0
    if rot_dim + rope_dim_offset > head_size:
        raise ValueError(f"rot_dim {rot_dim} + rope_dim_offset {rope_dim_offset} exceeds "
                         f"head_size {head_size}")
    # Added: the kernel's remaining assumptions.
    if rot_dim % 2 or rot_dim == 0:
        raise ValueError(f"rot_dim (cos_sin_cache's last dim) must be even and > 0, got {rot_dim}")
    _cupy.check_contiguous(cos_sin_cache, "cos_sin_cache")
    _cupy.check_contiguous(positions, "positions")
    if key is not None and num_kv_heads > 1 and k_head_stride != head_stride:
        raise ValueError(f"key's head stride {k_head_stride} differs from query's {head_stride} "
                         "(the kernel steps both by query's)")
    device = _cupy.check_cuda(("positions", positions), ("query", query),
                              ("cos_sin_cache", cos_sin_cache),
                              *((("key", key),) if key is not None else ()))
    max_position = cos_sin_cache.size(0)
    if check_positions_on_host and not _capturing():
        check_positions(positions, max_position)
    if num_heads == 0:
        return
    _cupy.launch(MODULE, kernel_name(query.dtype, cos_sin_cache.dtype, bool(is_neox)), device,
                 (num_tokens,), (block_size(num_heads, rot_dim), 1, 1),
                 (_cupy.ptr(positions), _cupy.ptr(query), _cupy.ptr(key),
                  _cupy.ptr(cos_sin_cache), _cupy.i32(rot_dim), _cupy.i64(query_stride),
                  _cupy.i64(key_stride), _cupy.i64(head_stride), _cupy.i32(num_heads),
                  _cupy.i32(num_kv_heads), _cupy.i32(head_size), _cupy.i64(rope_dim_offset),
                  bool(inverse), _cupy.i64(max_position)))


__all__ = ["MODULE", "MAX_THREADS", "block_size", "check_positions", "kernel_name",
           "rotary_embedding"]
