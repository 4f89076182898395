"""Host checks and launch of the vLLM ``fused_qk_norm_rope`` port: the original host function's
checks in its order, its choice of heads per warp and its two launch shapes, then the port's added
checks (each refuses an input the original would read or write out of bounds, or compute wrongly;
see :mod:`ports.vllm_port.qknorm`), then the device.
"""
from __future__ import annotations

import torch

from ports import _cupy
from ports.vllm_port._launch import KERNEL_TYPE, _capturing, check_positions
from reference.vocabulary import check_dtype

HEAD_DIMS = (64, 128, 256)             # the original's switch
HEADS_PER_WARP = (1, 2, 4, 8)          # token_heads_per_warp it accepts
BLOCK = 256                            # threads a block, both kernels
WARPS_PER_BLOCK = BLOCK // 32
QKV_TYPES = (torch.float16, torch.bfloat16)  # VLLM_STABLE_DISPATCH_HALF_TYPES
CACHE_TYPES = (torch.float32, torch.float16, torch.bfloat16)  # ..._FLOATING_TYPES


def _bool(b: bool) -> str:
    return "true" if b else "false"


def kernel_name(qkv_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int,
                interleave: bool, heads_per_warp: int) -> str:
    """The template instantiation launched: the one-head kernel, or the token-heads kernel."""
    args = f"{KERNEL_TYPE[qkv_dtype]}, {KERNEL_TYPE[cache_dtype]}, {head_dim}, {_bool(interleave)}"
    if heads_per_warp == 1:
        return f"fused_qk_norm_rope_kernel<{args}>"
    return f"fused_qk_norm_rope_token_heads_kernel<{args}, {heads_per_warp}>"


def _module(qkv_dtype: torch.dtype) -> _cupy.CudaModule:
    """Every instantiation the original's dispatch reaches for one qkv dtype (72 kernels: one
    module per dtype, so a bf16 run compiles half of them)."""
    return _cupy.CudaModule(
        "ports.vllm_port", "fused_qknorm_rope_kernel.cu", options=(),
        kernels=tuple(kernel_name(qkv_dtype, c, d, i, n) for c in CACHE_TYPES
                      for d in HEAD_DIMS for i in (False, True) for n in HEADS_PER_WARP))


MODULE_FP16 = _module(torch.float16)
MODULE_BF16 = _module(torch.bfloat16)
MODULES = {torch.float16: MODULE_FP16, torch.bfloat16: MODULE_BF16}


def auto_heads_per_warp(num_tokens: int, qk_heads: int, head_dim: int, sm: int) -> int:
    """The original's choice when ``forced_token_heads_per_warp <= 0``: thresholds measured on
    sm_90 by vLLM; every other architecture takes 1 (the one-head kernel)."""
    if sm != 90:
        return 1
    units = num_tokens * qk_heads
    if head_dim >= 256:
        return 1 if units < 4096 else 2 if units < 8192 else 4
    return 1 if units < 10240 else 4 if units < 40960 else 8


def launch_shape(num_tokens: int, qk_heads: int, head_dim: int, rotary_dim: int,
                 cache_itemsize: int, heads_per_warp: int) -> tuple[int, int, int]:
    """(grid, heads per warp actually used, dynamic shared bytes). The token-heads kernel falls
    back to the one-head kernel when the cos/sin row is not a whole number of 16-byte pieces, as
    the original does."""
    if heads_per_warp > 1 and (rotary_dim * cache_itemsize) % 16:
        heads_per_warp = 1
    chunks = -(-qk_heads // heads_per_warp)
    grid = -(-(num_tokens * chunks) // WARPS_PER_BLOCK)
    smem = 0 if heads_per_warp == 1 else WARPS_PER_BLOCK * (
        rotary_dim * cache_itemsize + heads_per_warp * 2 * head_dim)
    return grid, heads_per_warp, smem


def _check_1d_2d(t, name, ndim, what):
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D: {what}; got shape {tuple(t.shape)}")


def fused_qk_norm_rope(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int,
                       head_dim: int, eps: float, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
                       forced_token_heads_per_warp: int = -1, *,
                       check_positions_on_host: bool = True) -> None:
    """Normalise and rotate q and k of ``qkv`` in place; see
    :func:`ports.vllm_port.qknorm.fused_qk_norm_rope`."""
    named = (("qkv", qkv), ("position_ids", position_ids), ("q_weight", q_weight),
             ("k_weight", k_weight), ("cos_sin_cache", cos_sin_cache))
    for name, t in named:
        _cupy.check_tensor(t, name)
    for name, v in (("num_heads_q", num_heads_q), ("num_heads_k", num_heads_k),
                    ("num_heads_v", num_heads_v), ("head_dim", head_dim),
                    ("forced_token_heads_per_warp", forced_token_heads_per_warp)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    # The original's checks, in its order (CHECK_INPUT's contiguity, then types and shapes).
    for name, t in named:
        _cupy.check_contiguous(t, name)
    check_dtype(position_ids, "position_ids (the kernel reads int64)", (torch.int64,))
    _check_1d_2d(qkv, "qkv", 2, "[num_tokens, (num_heads_q + num_heads_k + num_heads_v) * "
                 "head_dim]")
    _check_1d_2d(position_ids, "position_ids", 1, "[num_tokens]")
    _check_1d_2d(q_weight, "q_weight", 1, "[head_dim]")
    _check_1d_2d(k_weight, "k_weight", 1, "[head_dim]")
    _check_1d_2d(cos_sin_cache, "cos_sin_cache", 2, "[max_position, rotary_dim]")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.size(0) != head_dim:
            raise ValueError(f"{name} has {w.size(0)} elements but head_dim is {head_dim}")
    rotary_dim = cos_sin_cache.size(1)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim (cos_sin_cache's last dim) must be even, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} exceeds head_dim {head_dim}")
    if not (qkv.dtype == q_weight.dtype == k_weight.dtype):
        raise TypeError(f"qkv, q_weight and k_weight must have the same dtype; got "
                        f"{qkv.dtype}, {q_weight.dtype}, {k_weight.dtype}")
    num_tokens = qkv.size(0)
    if position_ids.size(0) != num_tokens:
        raise ValueError(f"position_ids has {position_ids.size(0)} tokens but qkv has "
                         f"{num_tokens}")
    if min(num_heads_q, num_heads_k, num_heads_v) < 0:
        raise ValueError("head counts must be >= 0, got "
                         f"{(num_heads_q, num_heads_k, num_heads_v)}")
    total = num_heads_q + num_heads_k + num_heads_v
    if qkv.size(1) != total * head_dim:
        raise ValueError(f"qkv's row has {qkv.size(1)} elements but (num_heads_q + num_heads_k "
                         f"+ num_heads_v) * head_dim = {total} * {head_dim} = {total * head_dim}")
    if forced_token_heads_per_warp > 0 and forced_token_heads_per_warp not in HEADS_PER_WARP:
        raise ValueError("forced_token_heads_per_warp must be 1, 2, 4 or 8 (or <= 0 to let the "
                         f"op choose), got {forced_token_heads_per_warp}")
    if qkv.dtype not in QKV_TYPES:
        raise TypeError(f"qkv has dtype {qkv.dtype}; the original dispatches float16 and "
                        "bfloat16 only")
    if cos_sin_cache.dtype not in CACHE_TYPES:
        raise TypeError(f"cos_sin_cache has dtype {cos_sin_cache.dtype}; the original dispatches "
                        "float32, float16, bfloat16")
    if head_dim not in HEAD_DIMS:
        raise NotImplementedError(f"head_dim {head_dim} is not one the original instantiates "
                                  f"{HEAD_DIMS}")
    # Added: what the kernel's index math assumes.
    per_lane = head_dim // 32
    if rotary_dim == 0 or rotary_dim % per_lane:
        raise ValueError(f"rotary_dim {rotary_dim} must be a positive multiple of head_dim / 32 "
                         f"= {per_lane} (each lane rotates all its {per_lane} channels or none: "
                         "the original rotates past rotary_dim and reads the next cache entries "
                         "otherwise)")
    if is_neox and rotary_dim != head_dim:
        raise NotImplementedError(
            f"NeoX with rotary_dim {rotary_dim} < head_dim {head_dim}: the original exchanges "
            "pair halves with a full-warp __shfl_xor_sync that only the rotating lanes reach "
            "(undefined behaviour), and its xor partner is wrong unless R/2 / (head_dim/32) is "
            "a power of two; this port refuses partial rotary with is_neox=True")
    _cupy.check_index_fits(qkv.numel(), "qkv's element count (the original's int offsets)")
    device = _cupy.check_cuda(*named)
    _cupy.check_aligned(qkv, "qkv", 2 * per_lane)
    _cupy.check_aligned(cos_sin_cache, "cos_sin_cache", 16)
    max_position = cos_sin_cache.size(0)
    if check_positions_on_host and not _capturing():
        check_positions(position_ids, max_position)
    qk_heads = num_heads_q + num_heads_k
    if num_tokens == 0 or qk_heads == 0:
        return
    if forced_token_heads_per_warp > 0:
        wanted = forced_token_heads_per_warp
    else:
        major, minor = torch.cuda.get_device_capability(device)
        wanted = auto_heads_per_warp(num_tokens, qk_heads, head_dim, 10 * major + minor)
    grid, per_warp, smem = launch_shape(num_tokens, qk_heads, head_dim, rotary_dim,
                                        cos_sin_cache.element_size(), wanted)
    name = kernel_name(qkv.dtype, cos_sin_cache.dtype, head_dim, not is_neox, per_warp)
    _cupy.launch(MODULES[qkv.dtype], name, device, (grid,), (BLOCK, 1, 1),
                 (_cupy.ptr(qkv), _cupy.i32(num_heads_q), _cupy.i32(num_heads_k),
                  _cupy.i32(num_heads_v), _cupy.f32(eps), _cupy.ptr(q_weight),
                  _cupy.ptr(k_weight), _cupy.ptr(cos_sin_cache), _cupy.ptr(position_ids),
                  _cupy.i32(num_tokens), _cupy.i32(rotary_dim), _cupy.i64(max_position)),
                 shared_mem=smem)


__all__ = ["BLOCK", "HEAD_DIMS", "HEADS_PER_WARP", "MODULES", "MODULE_BF16", "MODULE_FP16",
           "auto_heads_per_warp",
           "fused_qk_norm_rope", "kernel_name", "launch_shape"]
