"""kernl's ``rmsnorm_triton`` and fused ``rms_matmul_rbe`` (seed 004): RMSNorm, the Q/K/V
projection and RoPE in one kernel.

Upstream: seed document 004 (kernl blog "Deep Dive into Kernel Fusion: Accelerating Inference in
Llama V2", sections "Simplified Fusions in RMSNorm" and "Converging complex operations into a big
fat kernel") and its project code ``ELS-RD/kernl@da9db806:experimental/llama-v2/kernel/
fused_kernel_proj_qkv.py`` (``rmsnorm_triton``, ``rmsnorm_triton_wrapper``, ``rms_matmul_rbe``,
``rms_matmul_rbe_wrapper``, ``rms_matmul_rbe_qkv``, ``rms_matmul_rbe_qkv_wrapper``). An independent
re-implementation of that design, not a copy. This is not a RoPE kernel the canonical cases can
call: it is a different experiment ("RoPE fused into the QKV projection"), benchmarked by
``compare.py --pipeline`` (:mod:`ports.harness.pipeline`) against the unfused pipeline.

Design kept
-----------
``rmsnorm_triton``: one program per ``(batch, token)`` row; two passes over the row in
``BLOCK_N_SIZE`` chunks (the second re-reads x, expecting it from L2): sum of squares in fp32,
``rstd = rsqrt(sum / N + eps)``, then ``x * rstd * rms_w`` stored in the output's dtype. ``N_SIZE``
and ``eps`` are constexprs, as upstream (a new hidden size or eps recompiles; M does not).

``rms_matmul_rbe``: ``out = RBE((rms(x) * rms_w) @ W^T)`` with x ``[batch, M, K]``, W the
``nn.Linear`` weight ``[N, K]`` (read through ``W.t()``'s strides), rms_w ``[K]``.

* Grid ``(batch, cdiv(M, BLOCK_SIZE_M) * cdiv(N, BLOCK_SIZE_N))``; a program owns one output tile.
* Prologue fused into the K loop: each step loads an x tile, adds its squares (fp32) to a
  ``[BLOCK_M, BLOCK_K]`` running sum, multiplies x by rms_w *in the storage dtype* (fp16 * fp16 as
  upstream), and accumulates ``tl.dot(x * rms_w, w)`` in fp32. Every program recomputes its rows'
  statistics (the blog's stated trade-off: extra compute for one read of x).
* RMSNorm applied after the matmul: ``acc *= rsqrt(sum / K + eps)`` per row (it commutes with the
  contraction over K).
* Rows and columns past M / N wrap (``% M``, ``% N``) on load; stores are masked. K has no mask: it
  must be a multiple of ``BLOCK_SIZE_K`` (upstream's TODO; here the wrapper raises).
* Epilogue, for Q and K only (``RBE_EPILOGUE`` constexpr; V skips it): store the tile,
  ``tl.debug_barrier()``, then run kernl's :func:`~ports.kernl.rbe_triton` in place over the same
  tile (same grid decomposition, ``BLOCK_SIZE_K := BLOCK_SIZE_N``), which re-reads the just-stored
  values, so the rotation sees the tile rounded to the storage dtype once (as upstream).
* Upstream's tile sizes and launch: ``BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64,
  num_stages=4, num_warps=4``; ``THETA=10000``, ``EPS=1e-6``.
* ``rms_matmul_rbe_qkv``: one launch running the fused kernel three times (q and k with the
  epilogue, v without), k and v written into caller-provided buffers (the KV cache).

Departures
----------
* No FP8 (``USE_FP8``, int8-stored e5m2 weights): dropped; weights are fp16, bf16 or fp32.
* ``x ** 2`` as ``x * x`` (upstream ``tl.math.pow(x, 2)``; Triton 3 has no ``tl.math.pow``).
* head_dim is a constexpr (``HEAD_DIM``) instead of the hard-coded ``DIM = 128``; the angle uses
  the existing port's ``get_freq_multi_tokens`` (libdevice pow on a GPU, exp2 under the
  interpreter; see :mod:`ports.kernl`).
* fp32 inputs are multiplied with ``input_precision="ieee"`` (a true fp32 matmul; Triton's default
  would be TF32). fp16/bf16 inputs use tensor cores as upstream.
* Program ids and row offsets are int64 before pointer arithmetic; the tile grid is refused past
  CUDA's grid-y limit (65535).
* bf16 is refused under the Triton interpreter (``NotImplementedError``): its ``tl.dot`` returns
  garbage for bf16 tiles (Triton 3.8); bf16 is tested on a GPU.
* Host checks before launch (``TypeError`` dtypes, ``ValueError`` shapes/devices/sizes) instead of
  asserts; an optional ``out``; the device guard; RMSNorm's weight may be any 1-D stride.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ports import _alloc, _triton
from ports.kernl.rbe import UPSTREAM, rbe_triton
from reference.vocabulary import check_dtype, check_rank


# ---- RMSNorm -------------------------------------------------------------------------------------
@triton.jit
def rmsnorm_triton(x_ptr, rms_w_ptr, out_ptr,
                   stride_x_batch, stride_x_m, stride_x_k,
                   stride_rms_w,
                   stride_out_batch, stride_out_m, stride_out_k,
                   N_SIZE: tl.constexpr, EPS: tl.constexpr, BLOCK_N_SIZE: tl.constexpr):
    pid_batch = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1).to(tl.int64)
    row = pid_batch * stride_x_batch + pid_m * stride_x_m
    cols = tl.arange(0, BLOCK_N_SIZE)

    # pass 1: sum of squares, element-wise in fp32, reduced once after the loop
    sq = tl.zeros((BLOCK_N_SIZE,), tl.float32)
    for start in range(0, N_SIZE, BLOCK_N_SIZE):
        offs = start + cols
        mask = offs < N_SIZE
        v = tl.load(x_ptr + row + offs * stride_x_k, mask=mask, other=0.0).to(tl.float32)
        sq += v * v
    rstd = tl.math.rsqrt(tl.sum(sq, axis=0) / N_SIZE + EPS)

    # pass 2: normalise and scale (x re-read, from L2 on a GPU)
    out_row = pid_batch * stride_out_batch + pid_m * stride_out_m
    for start in range(0, N_SIZE, BLOCK_N_SIZE):
        offs = start + cols
        mask = offs < N_SIZE
        w = tl.load(rms_w_ptr + offs * stride_rms_w, mask=mask)
        v = tl.load(x_ptr + row + offs * stride_x_k, mask=mask, other=0.0).to(tl.float32)
        y = (v * rstd) * w
        tl.store(out_ptr + out_row + offs * stride_out_k, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_eps(eps: float) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a positive finite float, got {eps!r}")


def rmsnorm_triton_wrapper(x: torch.Tensor, rms_w: torch.Tensor, eps: float = 1e-6, *,
                           out: torch.Tensor | None = None, block_n_size: int = 1024
                           ) -> torch.Tensor:
    """RMSNorm of ``x [batch, M, K]`` with weight ``rms_w [K]``; returns ``out`` (x's dtype)."""
    check_dtype(x, "x")
    check_dtype(rms_w, "rms_w")
    check_rank(x, "x", 3, "batch, M, K")
    check_rank(rms_w, "rms_w", 1, "K")
    batch, M, K = x.shape
    if rms_w.shape[0] != K:
        raise ValueError(f"rms_w has {rms_w.shape[0]} elements, x's last dim is {K}")
    _check_eps(eps)
    if not _triton.is_pow2(block_n_size):
        raise ValueError(f"block_n_size must be a power of two, got {block_n_size!r}")
    if M > _triton.MAX_GRID_Y:
        raise NotImplementedError(f"rmsnorm_triton puts the {M} tokens on grid axis 1, which CUDA "
                                  f"limits to {_triton.MAX_GRID_Y}")
    out = _triton.output_like(x, out)
    device = _triton.check_device(("x", x), ("rms_w", rms_w), ("out", out))
    if x.numel() == 0:
        return out
    with _triton.device_guard(device):
        rmsnorm_triton[(batch, M)](x, rms_w, out, *x.stride(), rms_w.stride(0), *out.stride(),
                                   N_SIZE=K, EPS=float(eps), BLOCK_N_SIZE=block_n_size)
    return out


# ---- fused RMSNorm + projection + RoPE -----------------------------------------------------------
@triton.jit
def rms_matmul_rbe(x_ptr, w_ptr, rms_w_ptr, out_ptr,
                   M, N, K,
                   stride_x_batch, stride_x_m, stride_x_k,
                   stride_w_k, stride_w_n,
                   stride_rms_w,
                   stride_out_batch, stride_out_m, stride_out_n,
                   start_token_position,
                   RBE_EPILOGUE: tl.constexpr,
                   THETA: tl.constexpr, LOG2_THETA: tl.constexpr, HEAD_DIM: tl.constexpr,
                   EPS: tl.constexpr,
                   BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                   BLOCK_SIZE_K: tl.constexpr,
                   LIBDEVICE_POW: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``out = RBE((rms(x) * rms_w) @ w)`` for one ``[BLOCK_M, BLOCK_N]`` tile (``w`` is ``[K, N]``
    through strides); RBE only if ``RBE_EPILOGUE``."""
    pid_batch = tl.program_id(axis=0).to(tl.int64)
    pid = tl.program_id(axis=1)
    n_blocks_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m = pid // n_blocks_n
    pid_n = pid % n_blocks_n

    # rows / columns past the edge wrap onto valid ones for the loads; the store is masked
    rows = ((pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)) % M).to(tl.int64)
    cols = ((pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)) % N).to(tl.int64)
    ks = tl.arange(0, BLOCK_SIZE_K).to(tl.int64)
    x_ptrs = x_ptr + (pid_batch * stride_x_batch + rows[:, None] * stride_x_m
                      + ks[None, :] * stride_x_k)
    w_ptrs = w_ptr + (ks[:, None] * stride_w_k + cols[None, :] * stride_w_n)
    rms_w_ptrs = rms_w_ptr + ks[None, :] * stride_rms_w

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_K), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        x = tl.load(x_ptrs)
        xf = x.to(tl.float32)
        sq += xf * xf                       # RMSNorm statistics, read along with the matmul
        x = x * tl.load(rms_w_ptrs)         # RMSNorm weight, in the storage dtype
        w = tl.load(w_ptrs)
        acc += tl.dot(x, w, input_precision=INPUT_PRECISION)  # the projection, fp32 accumulate
        x_ptrs += BLOCK_SIZE_K * stride_x_k
        w_ptrs += BLOCK_SIZE_K * stride_w_k
        rms_w_ptrs += BLOCK_SIZE_K * stride_rms_w
    rstd = tl.math.rsqrt(tl.sum(sq, axis=1) / K + EPS)
    acc = acc * rstd[:, None]               # RMSNorm applied to the matmul's output tile

    offs_m = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    out_ptrs = out_ptr + (pid_batch * stride_out_batch + offs_m[:, None] * stride_out_m
                          + offs_n[None, :] * stride_out_n)
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    if RBE_EPILOGUE:
        # the rotation re-reads this program's tile: make every thread's stores visible first
        tl.debug_barrier()
        rbe_triton(out_ptr, out_ptr, M, N,
                   stride_out_batch, stride_out_m, stride_out_n,
                   stride_out_batch, stride_out_m, stride_out_n,
                   start_token_position, THETA, LOG2_THETA, HEAD_DIM,
                   BLOCK_SIZE_M, BLOCK_SIZE_N, LIBDEVICE_POW)


@triton.jit
def rms_matmul_rbe_qkv(x_ptr, q_w_ptr, k_w_ptr, v_w_ptr, rms_w_ptr, q_ptr, k_ptr, v_ptr,
                       M, N, K,
                       stride_x_batch, stride_x_m, stride_x_k,
                       stride_q_w_k, stride_q_w_n, stride_k_w_k, stride_k_w_n,
                       stride_v_w_k, stride_v_w_n,
                       stride_rms_w,
                       stride_q_batch, stride_q_m, stride_q_n,
                       stride_k_batch, stride_k_m, stride_k_n,
                       stride_v_batch, stride_v_m, stride_v_n,
                       start_token_position,
                       THETA: tl.constexpr, LOG2_THETA: tl.constexpr, HEAD_DIM: tl.constexpr,
                       EPS: tl.constexpr,
                       BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                       BLOCK_SIZE_K: tl.constexpr,
                       LIBDEVICE_POW: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """q and k with RoPE, v without, in one launch (each program: the same tile of all three)."""
    rms_matmul_rbe(x_ptr, q_w_ptr, rms_w_ptr, q_ptr, M, N, K,
                   stride_x_batch, stride_x_m, stride_x_k, stride_q_w_k, stride_q_w_n,
                   stride_rms_w, stride_q_batch, stride_q_m, stride_q_n, start_token_position,
                   True, THETA, LOG2_THETA, HEAD_DIM, EPS, BLOCK_SIZE_M, BLOCK_SIZE_N,
                   BLOCK_SIZE_K, LIBDEVICE_POW, INPUT_PRECISION)
    rms_matmul_rbe(x_ptr, k_w_ptr, rms_w_ptr, k_ptr, M, N, K,
                   stride_x_batch, stride_x_m, stride_x_k, stride_k_w_k, stride_k_w_n,
                   stride_rms_w, stride_k_batch, stride_k_m, stride_k_n, start_token_position,
                   True, THETA, LOG2_THETA, HEAD_DIM, EPS, BLOCK_SIZE_M, BLOCK_SIZE_N,
                   BLOCK_SIZE_K, LIBDEVICE_POW, INPUT_PRECISION)
    rms_matmul_rbe(x_ptr, v_w_ptr, rms_w_ptr, v_ptr, M, N, K,
                   stride_x_batch, stride_x_m, stride_x_k, stride_v_w_k, stride_v_w_n,
                   stride_rms_w, stride_v_batch, stride_v_m, stride_v_n, start_token_position,
                   False, THETA, LOG2_THETA, HEAD_DIM, EPS, BLOCK_SIZE_M, BLOCK_SIZE_N,
                   BLOCK_SIZE_K, LIBDEVICE_POW, INPUT_PRECISION)


BLOCKS = dict(block_size_m=16, block_size_n=64, block_size_k=64)  # upstream's (3090-tuned)
LAUNCH = dict(num_stages=4, num_warps=4)


def _check_fused(x, weights, rms_w, start_pos, n_heads, head_dim, eps, theta, use_rbe,
                 block_size_m, block_size_n, block_size_k):
    """Host checks shared by both wrappers; returns ``(batch, M, N, K)``."""
    check_dtype(x, "x")
    check_rank(x, "x", 3, "batch, M, K")
    batch, M, K = x.shape
    for name, w in weights:
        check_dtype(w, name, (x.dtype,))
        check_rank(w, name, 2, "N, K (nn.Linear weight: out_features, in_features)")
    shapes = {tuple(w.shape) for _, w in weights}
    if len(shapes) != 1:
        raise ValueError("the weights must share one shape, got "
                         + ", ".join(f"{n} {tuple(w.shape)}" for n, w in weights))
    N, K_w = shapes.pop()
    if K_w != K:
        raise ValueError(f"weight is [N={N}, K={K_w}] but x's last dim is {K} (weight is the "
                         "nn.Linear layout [out_features, in_features])")
    check_dtype(rms_w, "rms_w", (x.dtype,))
    check_rank(rms_w, "rms_w", 1, "K")
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and _triton.interpreting():
        raise NotImplementedError("Triton's interpreter multiplies bf16 tiles wrongly in tl.dot "
                                  "(checked with Triton 3.8): bf16 runs on a GPU only")
    if rms_w.shape[0] != K:
        raise ValueError(f"rms_w has {rms_w.shape[0]} elements, x's last dim is {K}")
    for name, v in (("n_heads", n_heads), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if n_heads * head_dim != N:
        raise ValueError(f"n_heads * head_dim = {n_heads * head_dim} but the weight has N = {N} "
                         "output features")
    if use_rbe and head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
        raise ValueError(f"start_pos must be a non-negative int, got {start_pos!r}")
    if start_pos + M > 2**24:
        raise ValueError(f"positions up to {start_pos + M} are not exact in fp32 (limit 2^24)")
    _check_eps(eps)
    if not (isinstance(theta, (int, float)) and theta > 0 and math.isfinite(theta)):
        raise ValueError(f"theta must be positive and finite, got {theta!r}")
    for name, b in (("block_size_m", block_size_m), ("block_size_n", block_size_n),
                    ("block_size_k", block_size_k)):
        if not _triton.is_pow2(b) or b < 16:
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {b!r}")
    if K % block_size_k:
        raise ValueError(f"K = {K} must be a multiple of block_size_k = {block_size_k} (the K loop "
                         "has no mask, as upstream)")
    tiles = triton.cdiv(M, block_size_m) * triton.cdiv(N, block_size_n)
    if tiles > _triton.MAX_GRID_Y:
        raise NotImplementedError(f"{tiles} output tiles on grid axis 1 exceed CUDA's limit "
                                  f"{_triton.MAX_GRID_Y}; use larger block sizes")
    return batch, M, N, K


def _check_out(name, out, shape, dtype):
    check_dtype(out, name, (dtype,))
    if out.numel() != math.prod(shape):
        raise ValueError(f"{name} has shape {tuple(out.shape)}; expected {shape} elements")
    view = out.view(shape)  # raises if the memory cannot be viewed so
    return view


def _constexprs(device, dtype, theta, head_dim, eps, bm, bn, bk):
    return dict(THETA=float(theta), LOG2_THETA=math.log2(theta), HEAD_DIM=head_dim,
                EPS=float(eps), BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
                LIBDEVICE_POW=device.type == "cuda" and not _triton.interpreting(),
                INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32")


def rms_matmul_rbe_wrapper(x: torch.Tensor, weight: torch.Tensor, rms_w: torch.Tensor,
                           use_rbe: bool, start_pos: int, n_heads: int, head_dim: int, *,
                           eps: float = 1e-6, theta: float = 10000.0,
                           out: torch.Tensor | None = None,
                           block_size_m: int = BLOCKS["block_size_m"],
                           block_size_n: int = BLOCKS["block_size_n"],
                           block_size_k: int = BLOCKS["block_size_k"],
                           num_stages: int = LAUNCH["num_stages"],
                           num_warps: int = LAUNCH["num_warps"]) -> torch.Tensor:
    """One projection: ``RBE?(rmsnorm(x, rms_w) @ weight.T)`` as ``[batch, M, n_heads, head_dim]``.

    ``x [batch, M, K]``, ``weight [N, K]`` (``nn.Linear``), ``rms_w [K]``, one dtype; tokens sit at
    positions ``start_pos + m``. ``out`` (optional) is any tensor of ``batch * M * N`` elements
    viewable as ``[batch, M, N]``.
    """
    batch, M, N, K = _check_fused(x, [("weight", weight)], rms_w, start_pos, n_heads, head_dim,
                                  eps, theta, use_rbe, block_size_m, block_size_n, block_size_k)
    if out is None:
        out = _alloc.empty((batch, M, N), dtype=x.dtype, device=x.device)
    out3 = _check_out("out", out, (batch, M, N), x.dtype)
    device = _triton.check_device(("x", x), ("weight", weight), ("rms_w", rms_w), ("out", out))
    w_t = weight.t()
    if x.numel():
        grid = (batch, triton.cdiv(M, block_size_m) * triton.cdiv(N, block_size_n))
        with _triton.device_guard(device):
            rms_matmul_rbe[grid](
                x, w_t, rms_w, out3, M, N, K, *x.stride(), *w_t.stride(), rms_w.stride(0),
                *out3.stride(), start_pos, RBE_EPILOGUE=bool(use_rbe),
                **_constexprs(device, x.dtype, theta, head_dim, eps, block_size_m, block_size_n,
                              block_size_k),
                num_stages=num_stages, num_warps=num_warps)
    return out3.view(batch, M, n_heads, head_dim)


def rms_matmul_rbe_qkv_wrapper(x: torch.Tensor, start_pos: int, q_weight: torch.Tensor,
                               k_weight: torch.Tensor, v_weight: torch.Tensor,
                               rms_w: torch.Tensor, n_heads: int, head_dim: int,
                               k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                               eps: float = 1e-6, theta: float = 10000.0, *,
                               block_size_m: int = BLOCKS["block_size_m"],
                               block_size_n: int = BLOCKS["block_size_n"],
                               block_size_k: int = BLOCKS["block_size_k"],
                               num_stages: int = LAUNCH["num_stages"],
                               num_warps: int = LAUNCH["num_warps"]):
    """q, k, v ``[batch, M, n_heads, head_dim]`` of one Llama attention block in one launch.

    q and k are rotated (positions ``start_pos + m``), v is not. ``k`` and ``v`` are where to write
    (upstream: slices of the KV cache), each viewable as ``[batch, M, N]``; ``None`` allocates.
    """
    weights = [("q_weight", q_weight), ("k_weight", k_weight), ("v_weight", v_weight)]
    batch, M, N, K = _check_fused(x, weights, rms_w, start_pos, n_heads, head_dim, eps, theta,
                                  True, block_size_m, block_size_n, block_size_k)
    q3 = _alloc.empty((batch, M, N), dtype=x.dtype, device=x.device)
    k3 = (_alloc.empty((batch, M, N), dtype=x.dtype, device=x.device) if k is None
          else _check_out("k", k, (batch, M, N), x.dtype))
    v3 = (_alloc.empty((batch, M, N), dtype=x.dtype, device=x.device) if v is None
          else _check_out("v", v, (batch, M, N), x.dtype))
    device = _triton.check_device(("x", x), *weights, ("rms_w", rms_w), ("k", k3), ("v", v3))
    wq, wk, wv = q_weight.t(), k_weight.t(), v_weight.t()
    if x.numel():
        grid = (batch, triton.cdiv(M, block_size_m) * triton.cdiv(N, block_size_n))
        with _triton.device_guard(device):
            rms_matmul_rbe_qkv[grid](
                x, wq, wk, wv, rms_w, q3, k3, v3, M, N, K, *x.stride(),
                *wq.stride(), *wk.stride(), *wv.stride(), rms_w.stride(0),
                *q3.stride(), *k3.stride(), *v3.stride(), start_pos,
                **_constexprs(device, x.dtype, theta, head_dim, eps, block_size_m, block_size_n,
                              block_size_k),
                num_stages=num_stages, num_warps=num_warps)
    shape = (batch, M, n_heads, head_dim)
    return q3.view(shape), k3.view(shape), v3.view(shape)


__all__ = ["rmsnorm_triton", "rmsnorm_triton_wrapper", "rms_matmul_rbe", "rms_matmul_rbe_wrapper",
           "rms_matmul_rbe_qkv", "rms_matmul_rbe_qkv_wrapper", "UPSTREAM"]
