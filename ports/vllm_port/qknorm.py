"""vLLM's fused QK-norm + RoPE op, ported as CuPy RawKernels: ``fused_qk_norm_rope``.

Upstream:
``vllm-project/vllm@0f5257e245116449bfbe78a87c22aeef632eba8f:csrc/fused_qknorm_rope_kernel.cu``
(kernels and host function; Apache-2.0; vLLM adapted it from TensorRT-LLM's
``fusedQKNormRopeKernel.cu``), the op behind ``vllm._custom_ops.fused_qk_norm_rope``. Written
anew from the design, not copied. Forward only, in place, inference only, as upstream.

What the original does, kept here:

* ``qkv`` ``[T, (hq + hk + hv) * head_dim]``, contiguous, fp16 or bf16: each q head and each k
  head of every token is RMS-normalised with its ``[head_dim]`` weight (q_weight, k_weight, qkv's
  dtype) and rotated, in place; v is untouched (the layout a QKV projection writes);
* ``cos_sin_cache`` ``[max_position, rotary_dim]`` (each row the cos half then the sin half) in
  fp32, fp16 or bf16; ``position_ids`` int64 ``[T]``; NeoX (``is_neox``) or GPT-J pairs;
* one warp per (token, head), ``head_dim / 32`` channels a lane as one vector; fp32 math
  ``x * rsqrt(sum(x^2) / head_dim + eps) * w`` then ``x * cos -/+ y * sin``, one rounding at the
  store; head_dim 64, 128 or 256;
* on sm_90 (vLLM's measured thresholds) warps take 2, 4 or 8 heads of a token through shared
  memory with cp.async once there are enough (token, head) units
  (:func:`ports.vllm_port._qknorm_launch.auto_heads_per_warp`); ``forced_token_heads_per_warp``
  overrides the choice; the one-head kernel where the cos/sin row is not a multiple of 16 bytes;
* 32-bit element offsets; PDL's grid-dependency wait and trigger stay in the kernels (no-ops
  without the launch attribute, which the original sets only for <= 16 tokens).

Departures, each refusing an input the original would mishandle (an exception before any
launch), or bounding one it would read out of bounds:

* positions outside ``[0, max_position)`` (the original reads past the cache): refused by a host
  check (one reduction and a device sync; ``check_positions_on_host=False`` skips it); during
  CUDA-graph capture the kernels' own bound applies: they take ``max_position`` and write NaN to
  the rotated channels of such a token;
* ``rotary_dim`` must be a positive multiple of ``head_dim / 32`` (each lane rotates all of its
  channels or none: otherwise the original rotates past ``rotary_dim`` and reads the sin half or
  the next row as cos/sin);
* NeoX with ``rotary_dim < head_dim`` is refused (``NotImplementedError``): the original's pair
  exchange is a full-warp ``__shfl_xor_sync`` that only the rotating lanes execute (undefined
  behaviour) and its xor partner is wrong unless ``(R/2) / (head_dim/32)`` is a power of two;
* ``qkv`` with ``2^31`` elements or more is refused (the original's int offsets overflow);
  ``qkv`` must be ``2 * head_dim / 32``-byte aligned and the cache 16-byte aligned (vector loads
  and cp.async);
* the token-heads kernel syncs the warp after waiting for its cos/sin copies (other lanes
  copied the pieces a lane reads; upstream's GPT-J branch reads them without a barrier);
* head counts must be ``>= 0`` and ``eps`` a number ``>= 0``; empty inputs return at once;
* the tensors' CUDA placement is checked after the shapes and dtypes (the original checks it
  first, with contiguity), so every other refusal is named on any device;
* ``griddepcontrol`` PTX for ``cudaGridDependencySynchronize`` /
  ``cudaTriggerProgrammaticLaunchCompletion`` (what they are on sm_90); torch's Half/BFloat16 as
  ``__half``/``__nv_bfloat16``.

Not ported: ROCm and pre-sm_80 branches (the bf16 kernels return at once below sm_80 upstream).
"""
from __future__ import annotations

import torch

from ports.vllm_port._qknorm_launch import fused_qk_norm_rope as _fused

UPSTREAM = ("vllm-project/vllm@0f5257e24511:csrc/fused_qknorm_rope_kernel.cu "
            "(vllm._custom_ops.fused_qk_norm_rope)")


def fused_qk_norm_rope(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int,
                       head_dim: int, eps: float, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
                       forced_token_heads_per_warp: int = -1, *,
                       check_positions_on_host: bool = True) -> None:
    """vLLM's ``fused_qk_norm_rope``: per-head RMSNorm then RoPE of q and k in ``qkv``, in place.

    Parameters
    ----------
    qkv
        ``[T, (num_heads_q + num_heads_k + num_heads_v) * head_dim]``, contiguous, fp16 or bf16.
        Its q and k heads are overwritten; v is not touched.
    num_heads_q, num_heads_k, num_heads_v, head_dim
        Head counts and head size (64, 128 or 256).
    eps
        RMSNorm's epsilon.
    q_weight, k_weight
        ``[head_dim]``, qkv's dtype, contiguous.
    cos_sin_cache
        ``[max_position, rotary_dim]``, contiguous, fp32/fp16/bf16: row ``p`` is
        ``cos(p * w_0 .. p * w_{R/2-1})`` then ``sin(...)``.
    is_neox
        True: pairs ``(i, i + R/2)`` (full rotary only); False (GPT-J): ``(2i, 2i+1)``.
    position_ids
        int64 ``[T]``, contiguous; each in ``[0, max_position)``.
    forced_token_heads_per_warp
        ``<= 0``: the original's choice; 1, 2, 4 or 8: that many heads a warp.
    check_positions_on_host
        Refuse out-of-range positions before launch (a device sync; skipped during CUDA-graph
        capture, where the kernel writes NaN for them instead).

    Example
    -------
    >>> fused_qk_norm_rope(qkv, 32, 8, 8, 128, 1e-6, qw, kw, cache, True, pos)  # doctest: +SKIP
    """
    _fused(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
           cos_sin_cache, is_neox, position_ids, forced_token_heads_per_warp,
           check_positions_on_host=check_positions_on_host)


__all__ = ["UPSTREAM", "fused_qk_norm_rope"]
