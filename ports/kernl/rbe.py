"""kernl's standalone ``rbe_triton`` kernel and its wrapper (the port's header, with its upstream
and departures, is :mod:`ports.kernl`)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ports import _triton
from reference.vocabulary import check_dtype, check_rank

UPSTREAM = "ELS-RD/kernl@da9db806:experimental/llama-v2/kernel/fused_kernel_proj_qkv.py"


@triton.jit
def get_freq_multi_tokens(offs_cn, starting_idx, THETA: tl.constexpr, LOG2_THETA: tl.constexpr,
                          HEAD_DIM: tl.constexpr, NB_TOKENS: tl.constexpr,
                          LIBDEVICE_POW: tl.constexpr):
    """cos/sin ``[NB_TOKENS, len(offs_cn)]`` for even channels ``offs_cn`` of tokens from
    ``starting_idx``: angle = pos / THETA ** ((n % HEAD_DIM) / HEAD_DIM), in fp32."""
    expo = (offs_cn % HEAD_DIM).to(tl.float32) / HEAD_DIM
    if LIBDEVICE_POW:
        freqs = libdevice.pow(tl.full(expo.shape, THETA, tl.float32), expo)
    else:
        freqs = tl.exp2(expo * LOG2_THETA)
    pos = (tl.arange(0, NB_TOKENS) + starting_idx).to(tl.float32)
    angle = pos[:, None] / freqs[None, :]
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def rbe_triton(x_ptr, out_ptr,
               M, K,
               stride_x_batch, stride_x_m, stride_x_n,
               stride_out_batch, stride_out_m, stride_out_n,
               start_token_position,
               THETA: tl.constexpr, LOG2_THETA: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
               LIBDEVICE_POW: tl.constexpr):
    pid_batch = tl.program_id(axis=0).to(tl.int64)
    pid = tl.program_id(axis=1)
    n_blocks_k = tl.cdiv(K, BLOCK_SIZE_K)
    pid_m = (pid // n_blocks_k).to(tl.int64)
    pid_n = pid % n_blocks_k

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_K + tl.arange(0, BLOCK_SIZE_K // 2) * 2  # even channels
    real_mask = (offs_m[:, None] < M) & (offs_n[None, :] < K)
    imag_mask = (offs_m[:, None] < M) & (offs_n[None, :] + 1 < K)

    x_ptrs = x_ptr + (pid_batch * stride_x_batch + offs_m[:, None] * stride_x_m
                      + offs_n[None, :] * stride_x_n)
    real = tl.load(x_ptrs, mask=real_mask, other=0.0).to(tl.float32)
    imag = tl.load(x_ptrs + stride_x_n, mask=imag_mask, other=0.0).to(tl.float32)

    start_block = start_token_position + pid_m * BLOCK_SIZE_M
    cos, sin = get_freq_multi_tokens(offs_n, start_block, THETA, LOG2_THETA, HEAD_DIM,
                                     BLOCK_SIZE_M, LIBDEVICE_POW)
    out_real = real * cos - imag * sin
    out_imag = real * sin + imag * cos

    out_ptrs = out_ptr + (pid_batch * stride_out_batch + offs_m[:, None] * stride_out_m
                          + offs_n[None, :] * stride_out_n)
    tl.store(out_ptrs, out_real.to(out_ptr.dtype.element_ty), mask=real_mask)
    tl.store(out_ptrs + stride_out_n, out_imag.to(out_ptr.dtype.element_ty), mask=imag_mask)


def rbe_triton_wrapper(x: torch.Tensor, pos: int, *, head_dim: int = 128,
                       theta: float = 10000.0, out: torch.Tensor | None = None,
                       block_size_m: int = 2, block_size_k: int = 1024) -> torch.Tensor:
    """Interleaved RoPE of ``x [batch, M, heads * head_dim]`` for tokens at ``pos, pos+1, ...``.

    Returns ``out`` (a new contiguous tensor unless one is given).
    """
    check_dtype(x, "x")
    check_rank(x, "x", 3, "batch, M, heads * head_dim")
    if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
        raise ValueError(f"pos (start_token_position) must be a non-negative int, got {pos!r}")
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    batch, M, K = x.shape
    if K % head_dim:
        raise ValueError(f"x's last dim {K} is not a multiple of head_dim {head_dim}")
    if not (_triton.is_pow2(block_size_m) and _triton.is_pow2(block_size_k) and block_size_k >= 2):
        raise ValueError(f"block sizes must be powers of two (BLOCK_SIZE_K >= 2), got "
                         f"{block_size_m}, {block_size_k}")
    if not (theta > 0 and math.isfinite(theta)):
        raise ValueError(f"theta must be positive and finite, got {theta!r}")
    if pos + M > 2**24:
        raise ValueError(f"positions up to {pos + M} are not exact in fp32 (limit 2^24)")
    out = _triton.output_like(x, out)
    device = _triton.check_device(("x", x), ("out", out))
    if x.numel() == 0:
        return out
    grid = (batch, triton.cdiv(M, block_size_m) * triton.cdiv(K, block_size_k))
    if grid[1] > _triton.MAX_GRID_Y:
        raise NotImplementedError(
            f"kernl's rbe_triton puts its {grid[1]} (token, channel) tiles on grid axis 1, which "
            f"CUDA limits to {_triton.MAX_GRID_Y}; refused (a larger BLOCK_SIZE_M/K lowers the "
            "count)")
    with _triton.device_guard(device):
        rbe_triton[grid](x, out, M, K, *x.stride(), *out.stride(), pos,
                         THETA=float(theta), LOG2_THETA=math.log2(theta), HEAD_DIM=head_dim,
                         BLOCK_SIZE_M=block_size_m, BLOCK_SIZE_K=block_size_k,
                         LIBDEVICE_POW=device.type == "cuda" and not _triton.interpreting())
    return out
