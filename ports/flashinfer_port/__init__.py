"""FlashInfer's RoPE kernels, ported as CuPy RawKernels behind the API of ``flashinfer/rope.py``.

Upstream: ``flashinfer-ai/flashinfer@fb28d7242b35:include/flashinfer/pos_enc.cuh`` (kernels and
launchers), ``csrc/rope.cu`` (the bindings' checks) and ``flashinfer/rope.py`` (the Python API:
output allocation, argument defaults). Apache-2.0; written anew from the original, keeping its
structure (``pos_enc.cu`` beside this file).

The package is ``ports.flashinfer_port``, its rows ``flashinfer_port.*`` in family
``flashinfer_port``: ``ports/peers`` already maps the installed ``flashinfer`` package under the
family ``flashinfer`` and rows ``flashinfer.*``, and the bit-for-bit test imports both, so the
port takes a name that reads differently from the library's.

Functions (each as in ``flashinfer.rope``; q ``(nnz, num_qo_heads, head_dim)``, k ``(nnz,
num_kv_heads, head_dim)``, fp16 or bf16, last dim contiguous, token and head strides free):

* :func:`apply_rope` / :func:`apply_rope_inplace`: ragged segments (``indptr``) each starting at
  its ``offsets`` entry; angles computed in the kernel from ``rope_theta`` / ``rope_scale``;
* :func:`apply_rope_pos_ids` / :func:`apply_rope_pos_ids_inplace`: one position per token;
* :func:`apply_llama31_rope` (``_inplace``, ``_pos_ids``, ``_pos_ids_inplace``): the same with
  Llama 3.1's frequency scaling (``low_freq_factor``, ``high_freq_factor``,
  ``old_context_len``);
* :func:`apply_rope_with_cos_sin_cache` / ``_inplace``: vLLM's signature ``(positions, query,
  key, head_size, cos_sin_cache, is_neox)`` with an fp32 ``[max_pos, rotary_dim]`` cache
  (``cat(cos, sin)`` of the half-width tables).

The same commit's fused QK RMSNorm + 3-D RoPE (``fused_qk_rmsnorm_rope``, a video-diffusion
kernel that normalises over all heads of a token) is ported beside them in
:mod:`ports.flashinfer_port.qknorm` (its own header and departures) and re-exported here.

Kept from the original: the per-thread vector layout and block shape; the strategy choice of the
pos_ids and cache paths (sequential heads when the token blocks fill the GPU's resident slots by
``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` x SMs, else head-parallel; the Llama 3.1
pos_ids path always sequential, as its launcher is); fp32 math with one rounding at the store;
``__powf`` / ``__sincosf`` and ``--use_fast_math``; the fp32 launch parameters (``1.0f / x``,
``smooth_a`` from a double); ``size_t`` strides, uint32 token and head indices; the cache's row
offset ``pos * rotary_dim`` in the position's integer type; no shared memory.

Departures (each refuses an input the original mishandles, unless marked "kernel"):

* kernel: interleaved cache reads load the half of each cos/sin vector the rotation uses (the
  original loads a whole vector and, for a row's last thread, reads past the row: past the cache
  on its last row);
* kernel: the cache kernels take the cache's row count and give a token whose position lies
  outside the cache NaN cos/sin instead of reading past it (reached when the host check below
  is skipped or cannot run, inside a CUDA-graph capture; else the host refuses such positions);
* kernel: the indptr kernel takes nnz and leaves a segment whose bounds fall outside
  ``[0, nnz]`` or decrease unwritten instead of reading and writing outside q and k (reached
  when the host check below is skipped or inside a capture; else the host refuses such indptr);
* positions (cache path) must lie in ``[0, max_pos)`` (the original reads past the cache): the
  host reads their range (``aminmax`` and a copy to the host); ``indptr`` must rise within
  ``[0, nnz]``: read on the host. Each read is a device sync the original does not have (the
  call waits for the stream's queued work), so each is optional: keyword-only
  ``check_positions_on_host`` / ``check_indptr_on_host`` (default True; False makes the call
  the original's work, for trusted indices). Skipped, or during a CUDA-graph capture (where
  no value can be read), the kernel bounds above apply instead. The registry rows check once
  when they build their inputs and time the call without the sync;
* ``pos_ids`` must have one entry per token, ``indptr`` ``batch_size + 1`` entries, all index
  tensors contiguous int32/int64 (the original reads as many as it needs);
* ``rotary_dim`` in ``(0, head_dim]`` and a multiple of the thread's vector (``2 * vec_size``
  for rotate-half, ``vec_size`` for interleaved): the original rotates whole vectors, so any other
  value pairs lanes across the rotary boundary (a silent wrong answer) or, past ``head_dim``,
  reads the next head;
* q, k, their outputs and the cache must be 16-byte aligned with token/head strides in whole
  16-byte vectors (the original's vector loads fault otherwise);
* q and k must share a dtype (the original reinterprets k as q's type);
* int32 positions with a cache whose last row starts past ``2^32 - 1`` (the 32-bit row offset)
  are refused, as are more than ``2^32 - 1`` tokens (uint32 token index) and head or segment
  counts past the grid's limits (the original's launch fails);
* ``rope_scale``, ``rope_theta`` must be positive and the Llama 3.1 factors satisfy
  ``0 < low < high``, ``old_context_len > 0`` (the original computes inf/NaN frequencies);
* head sizes other than 64, 128, 256, 512 raise NotImplementedError on every path: the computed
  paths' ``DISPATCH_HEAD_DIM`` refuses them too, while the cache path routes them upstream to
  ``RopeQuantize`` (fp8 quantising RoPE kernels), which is not ported;
* structure: the indptr kernel's q and k branches are one code path over selected pointers
  and strides (the same per-thread work); the sequential/head-parallel switch reads this build's
  occupancy (NVRTC's registers), so its switch point may differ from a FlashInfer wheel's;
* not ported: ``RopeQuantize``, ``rope_quantize_fp8``, ``mla_rope_quantize_fp8``, the paged KV
  append kernels, ALiBi, and ``vec_t`` / ``DISPATCH_*`` beyond what these kernels use (``vec_t``
  is reduced to an fp32 array with 16-byte cast loads/stores); no ``register_custom_op`` /
  fake-op wrappers (the ports call kernels directly).
"""
from __future__ import annotations

import torch

from ports import _alloc
from ports.flashinfer_port._launch import (
    batch_qk_apply_rotary, batch_qk_apply_rotary_cos_sin_cache, batch_qk_apply_rotary_pos_ids,
    rope_parameters,
)

UPSTREAM = ("flashinfer-ai/flashinfer@fb28d7242b35:include/flashinfer/pos_enc.cuh (host: "
            "csrc/rope.cu, flashinfer/rope.py)")
LLAMA31_DEFAULTS = dict(rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                        old_context_len=8192)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like`` (the original's allocation: a dense input's strides are kept),
    NaN-filled inside :func:`ports._alloc.poisoned`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    out = torch.empty_like(t)
    if _alloc.poisoning():
        out.fill_(float("nan"))
    return out


def _rotary_dim(q: torch.Tensor, rotary_dim: int | None) -> int:
    return q.size(-1) if rotary_dim is None else rotary_dim


def _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len):
    return rope_parameters(rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                           float(old_context_len))


# ---- indptr + offsets ----------------------------------------------------------------------------
def apply_rope_inplace(q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor,
                       offsets: torch.Tensor, rotary_dim: int | None = None,
                       interleave: bool = False, rope_scale: float = 1,
                       rope_theta: float = 1e4, *, check_indptr_on_host: bool = True) -> None:
    """Rotate ragged q ``(nnz, Hq, D)`` and k ``(nnz, Hk, D)`` in place: segment ``i`` is tokens
    ``indptr[i]:indptr[i+1]`` at positions ``offsets[i] + 0, 1, ...`` (``indptr``, ``offsets``
    int32 or int64, ``(B + 1,)`` and ``(B,)``). ``interleave``: pairs ``(2j, 2j+1)``, else
    ``(j, j + R/2)``. ``check_indptr_on_host`` (added, keyword-only): read ``indptr`` on the host
    and refuse one that leaves ``[0, nnz]`` or falls (a sync the original does not have); False
    leaves the call the original's work, and the kernel skips such a segment."""
    batch_qk_apply_rotary(q, k, q, k, indptr, offsets, _rotary_dim(q, rotary_dim), interleave,
                          rope_parameters(rope_scale, rope_theta),
                          check_indptr_on_host=check_indptr_on_host)


def apply_rope(q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor, offsets: torch.Tensor,
               rotary_dim: int | None = None, interleave: bool = False, rope_scale: float = 1,
               rope_theta: float = 1e4, *, check_indptr_on_host: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope_inplace` into new tensors ``(q_rope, k_rope)`` (``torch.empty_like``)."""
    q_rope, k_rope = _empty_like(q), _empty_like(k)
    batch_qk_apply_rotary(q, k, q_rope, k_rope, indptr, offsets, _rotary_dim(q, rotary_dim),
                          interleave, rope_parameters(rope_scale, rope_theta),
                          check_indptr_on_host=check_indptr_on_host)
    return q_rope, k_rope


def apply_llama31_rope_inplace(q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor,
                               offsets: torch.Tensor, rotary_dim: int | None = None,
                               interleave: bool = False, rope_scale: float = 8,
                               rope_theta: float = 5e5, low_freq_factor: float = 1,
                               high_freq_factor: float = 4, old_context_len: int = 8192, *,
                               check_indptr_on_host: bool = True) -> None:
    """:func:`apply_rope_inplace` with Llama 3.1's scaled frequencies (computed in the kernel)."""
    batch_qk_apply_rotary(q, k, q, k, indptr, offsets, _rotary_dim(q, rotary_dim), interleave,
                          _llama31(rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                                   old_context_len), check_indptr_on_host=check_indptr_on_host)


def apply_llama31_rope(q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor,
                       offsets: torch.Tensor, rotary_dim: int | None = None,
                       interleave: bool = False, rope_scale: float = 8, rope_theta: float = 5e5,
                       low_freq_factor: float = 1, high_freq_factor: float = 4,
                       old_context_len: int = 8192, *, check_indptr_on_host: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_llama31_rope_inplace` into new tensors ``(q_rope, k_rope)``."""
    q_rope, k_rope = _empty_like(q), _empty_like(k)
    batch_qk_apply_rotary(q, k, q_rope, k_rope, indptr, offsets, _rotary_dim(q, rotary_dim),
                          interleave, _llama31(rope_scale, rope_theta, low_freq_factor,
                                               high_freq_factor, old_context_len),
                          check_indptr_on_host=check_indptr_on_host)
    return q_rope, k_rope


# ---- per-token positions -------------------------------------------------------------------------
def apply_rope_pos_ids_inplace(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                               rotary_dim: int | None = None, interleave: bool = False,
                               rope_scale: float = 1, rope_theta: float = 1e4) -> None:
    """Rotate q ``(nnz, Hq, D)`` and k ``(nnz, Hk, D)`` in place, token ``t`` at position
    ``pos_ids[t]`` (int32 or int64, ``(nnz,)``)."""
    batch_qk_apply_rotary_pos_ids(q, k, q, k, pos_ids, _rotary_dim(q, rotary_dim), interleave,
                                  rope_parameters(rope_scale, rope_theta))


def apply_rope_pos_ids(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                       rotary_dim: int | None = None, interleave: bool = False,
                       rope_scale: float = 1, rope_theta: float = 1e4
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope_pos_ids_inplace` into new tensors ``(q_rope, k_rope)``."""
    q_rope, k_rope = _empty_like(q), _empty_like(k)
    batch_qk_apply_rotary_pos_ids(q, k, q_rope, k_rope, pos_ids, _rotary_dim(q, rotary_dim),
                                  interleave, rope_parameters(rope_scale, rope_theta))
    return q_rope, k_rope


def apply_llama31_rope_pos_ids_inplace(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                                       rotary_dim: int | None = None, interleave: bool = False,
                                       rope_scale: float = 8, rope_theta: float = 5e5,
                                       low_freq_factor: float = 1, high_freq_factor: float = 4,
                                       old_context_len: int = 8192) -> None:
    """:func:`apply_rope_pos_ids_inplace` with Llama 3.1's scaled frequencies."""
    batch_qk_apply_rotary_pos_ids(q, k, q, k, pos_ids, _rotary_dim(q, rotary_dim), interleave,
                                  _llama31(rope_scale, rope_theta, low_freq_factor,
                                           high_freq_factor, old_context_len), llama31=True)


def apply_llama31_rope_pos_ids(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                               rotary_dim: int | None = None, interleave: bool = False,
                               rope_scale: float = 8, rope_theta: float = 5e5,
                               low_freq_factor: float = 1, high_freq_factor: float = 4,
                               old_context_len: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_llama31_rope_pos_ids_inplace` into new tensors ``(q_rope, k_rope)``."""
    q_rope, k_rope = _empty_like(q), _empty_like(k)
    batch_qk_apply_rotary_pos_ids(q, k, q_rope, k_rope, pos_ids, _rotary_dim(q, rotary_dim),
                                  interleave, _llama31(rope_scale, rope_theta, low_freq_factor,
                                                       high_freq_factor, old_context_len),
                                  llama31=True)
    return q_rope, k_rope


# ---- cos/sin cache (vLLM's signature) ------------------------------------------------------------
def _heads_view(x: torch.Tensor, head_size: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"query and key must be torch.Tensors, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"query/key must be (nnz, heads * head_size) or (nnz, heads, head_size), "
                         f"got shape {tuple(x.shape)}")
    if x.dim() == 3 and x.shape[2] == head_size:
        return x
    if x.numel() % max(x.shape[0], 1) or (x.numel() // max(x.shape[0], 1)) % head_size:
        raise ValueError(f"query/key of shape {tuple(x.shape)} is not a whole number of heads of "
                         f"head_size {head_size}")
    return x.view(x.shape[0], -1, head_size)


def apply_rope_with_cos_sin_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                  head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool = True,
                                  *, check_positions_on_host: bool = True
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's signature: ``positions`` ``(nnz,)`` int32/int64, ``query`` ``(nnz, Hq * head_size)``,
    ``key`` ``(nnz, Hk * head_size)``, ``cos_sin_cache`` fp32 ``(max_pos, rotary_dim)`` = cos of
    the ``R/2`` pairs then their sin; ``is_neox``: rotate-half, else interleaved. Returns new
    ``(query_out, key_out)`` of the inputs' shapes. ``check_positions_on_host`` (added,
    keyword-only): read the positions' range on the host and refuse one outside the cache (a
    sync the original does not have); False leaves the call the original's work, and the kernel
    gives such a token NaN."""
    if not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    if isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    q, k = _heads_view(query, head_size), _heads_view(key, head_size)
    query_out, key_out = _empty_like(query), _empty_like(key)
    batch_qk_apply_rotary_cos_sin_cache(q, k, _heads_view(query_out, head_size),
                                        _heads_view(key_out, head_size), cos_sin_cache,
                                        positions, not is_neox,
                                        check_positions_on_host=check_positions_on_host)
    return query_out, key_out


def apply_rope_with_cos_sin_cache_inplace(positions: torch.Tensor, query: torch.Tensor,
                                          key: torch.Tensor, head_size: int,
                                          cos_sin_cache: torch.Tensor, is_neox: bool = True,
                                          *, check_positions_on_host: bool = True) -> None:
    """:func:`apply_rope_with_cos_sin_cache`, writing into ``query`` and ``key``."""
    if not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    if isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    q, k = _heads_view(query, head_size), _heads_view(key, head_size)
    batch_qk_apply_rotary_cos_sin_cache(q, k, q, k, cos_sin_cache, positions, not is_neox,
                                        check_positions_on_host=check_positions_on_host)


from ports.flashinfer_port.qknorm import fused_qk_rmsnorm_rope  # noqa: E402  (fused QK norm)

__all__ = ["UPSTREAM", "LLAMA31_DEFAULTS", "fused_qk_rmsnorm_rope",
           "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids",
           "apply_rope_pos_ids_inplace", "apply_llama31_rope", "apply_llama31_rope_inplace",
           "apply_llama31_rope_pos_ids", "apply_llama31_rope_pos_ids_inplace",
           "apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace"]
