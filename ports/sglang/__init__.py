"""SGLang's sgl-kernel RoPE, ported as CuPy RawKernels: ``apply_rope_with_cos_sin_cache_inplace``
(with its fused KV-cache store) and ``rotary_embedding``, the any-head-size kernel (head size 80).

Upstream (Apache-2.0), read file by file at these commits (the repository is too large to fetch
whole; each a stored version with enable_pdl and the fused KV store, not proven the newest):

* ``sgl-project/sglang@00694356:sgl-kernel/python/sgl_kernel/elementwise.py``
  (``apply_rope_with_cos_sin_cache_inplace``, ``FusedSetKVBufferArg``);
* ``sgl-project/sglang@8704aa6a:sgl-kernel/csrc/elementwise/rope.cu`` (host checks and the
  branch between the two kernel families);
* ``sgl-project/sglang@54ac12ac:sgl-kernel/csrc/elementwise/pos_enc.cuh`` (SGLang's "Enhanced"
  kernels and their launcher, over FlashInfer's ``pos_enc.cuh``: sgl-kernel pins FlashInfer
  ``bc29697ba20b``; the helpers were read at ``flashinfer-ai/flashinfer@fb28d7242b35``);
* ``sgl-project/sglang@02f22ef8:sgl-kernel/csrc/multimodal/rotary_embedding.cu``
  (``rotary_embedding``);
* ``sgl-project/sglang@00390b86:sgl-kernel/CMakeLists.txt`` (sm_90 flags: ``-use_fast_math``,
  ``-maxrregcount=128``).

What is SGLang's own and what is FlashInfer's:

* Without ``fused_set_kv_buffer_arg``, sgl-kernel's ``rope.cu`` calls FlashInfer's
  ``BatchQKApplyRotaryPosIdsCosSinCache`` unchanged: that path is FlashInfer's design (its port
  is FlashInfer's ``apply_rope_with_cos_sin_cache_inplace``). With the fused argument it calls
  SGLang's ``BatchQKApplyRotaryPosIdsCosSinCacheEnhanced``: a copy of FlashInfer's two cache
  kernels (same vector layout, same rotation helpers, same occupancy-based grid choice) that adds
  the store of rotated k and of v into the KV cache at ``cache_loc`` and programmatic dependent
  launch (``enable_pdl``). The upstream comment calls the Enhanced path feature-complete and meant
  to replace the other; this port runs it for both, ``save_kv_cache`` false without the fused
  argument (on that path the two are the same kernels, so its rows match FlashInfer's).
* FlashInfer's helpers the kernels call (16-byte ``vec_t`` loads/stores, the two rotations,
  ``DISPATCH_HEAD_DIM``) are rewritten in ``rope.cu`` and named there as FlashInfer's.
* ``rotary_embedding`` (``csrc/multimodal``) is SGLang's own, written from vLLM's scalar kernel:
  any head size, one block per token, per-token cos/sin rows in x's dtype. It is what head size
  80 runs on: FlashInfer's dispatch takes only head dims 64, 128, 256, 512.

Departures (each refuses or fixes what the original mishandles, or says what it cannot do):

* Without the fused argument the original launches FlashInfer's kernel; the port launches the
  Enhanced kernel with ``save_kv_cache`` false: the same loads, rotation and grid choice, plus
  the ``griddepcontrol`` instructions, which do nothing in an ordinary launch.

* ``enable_pdl``: the kernels keep their ``griddepcontrol`` instructions (sm_90+), but CuPy's
  launch cannot set the programmatic-stream-serialization attribute, so the launch is an
  ordinary one (``griddepcontrol.wait`` then returns at once). ``enable_pdl=None`` resolves as
  the original does (sm_90+ and the fused path) and ``True`` without the fused path is refused,
  as the original refuses it.
* Interleaved cache kernels load the ``vec_size / 2`` cos/sin values they use instead of
  ``vec_size`` (the original reads past the cache on its last row).
* The cache kernels take the cache's row count and give a token whose position lies
  outside ``[0, max_seq_len)`` NaN cos/sin (its rotated lanes come out NaN, the rest are copied)
  instead of reading past the cache, as the FlashInfer port's cache kernels do; they also take
  the rows both KV buffers have and skip the store of a token whose ``cache_loc`` lies outside
  them (its rotated k is still written to ``key``) instead of writing past ``k_buffer`` and
  ``v_buffer``. Reached only where the host check below is skipped or cannot run, inside a
  CUDA-graph capture; else the host refuses such indices.
* ``pos_ids`` must lie in ``[0, max_seq_len)`` and ``cache_loc`` in the rows both KV buffers
  have (the original reads past the cache and writes past the buffers): the host reads their
  range (``aminmax`` and a copy to the host). Each read is a device sync the original does not
  have (the call waits for the stream's queued work), so each is optional: keyword-only
  ``check_positions_on_host`` / ``check_cache_loc_on_host`` (default True; False makes the call
  the original's work, for trusted indices). Skipped, or during a CUDA-graph capture (where no
  value can be read), the kernel bounds above apply instead. The registry rows check once when
  they build their inputs and time the call without the sync.
* Added host checks: int64 ``pos_ids`` and ``cache_loc`` and an fp32 cache as the kernels read
  them; q, k, v and the buffers one dtype; ``v`` ``[nnz, H_K, D]``; 16-byte aligned rows for the
  vector loads; the rotary width a multiple of the vector (``2 * vec_size`` rotate-half,
  ``vec_size`` interleaved), where the original pairs a straddling vector wrongly without a word.
* ``rotary_embedding``: the rotated width must fit the head (the original walks past each head),
  cos/sin must be dense, and element counts past int32 are refused (the original's int32 token
  offsets overflow); float64 is not instantiated.
* The in-place rotate-half reads partner vectors that other threads of the same warp write;
  like the original, the port relies on one head being one warp, whose loads precede its stores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ports.sglang._launch import (
    apply_rope_pos_ids_cos_sin_cache, check_cache_loc, check_positions, rotary_embedding,
)

UPSTREAM = ("sgl-project/sglang@54ac12ace81e:sgl-kernel/csrc/elementwise/pos_enc.cuh "
            "(rope.cu@8704aa6a, python/sgl_kernel/elementwise.py@00694356); "
            "sgl-project/sglang@02f22ef8fc3a:sgl-kernel/csrc/multimodal/rotary_embedding.cu")


@dataclass
class FusedSetKVBufferArg:
    """The KV-cache store fused into the rotation.

    value : ``[nnz, num_kv_heads * head_size]`` (or 3-D), stored unrotated.
    k_buffer, v_buffer : ``[rows, num_kv_heads * head_size]`` (or 3-D) KV caches.
    k_scale, v_scale : must be ``None`` (not supported upstream either).
    cache_loc : int64 ``[nnz]``, the cache row of each token.
    """

    value: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    k_scale: float | None
    v_scale: float | None
    cache_loc: torch.Tensor


def _view_3d(x: torch.Tensor, head_size: int) -> torch.Tensor:
    return x.view(x.shape[0], -1, head_size)


def is_arch_support_pdl(device: torch.device | int | None = None) -> bool:
    """sm_90 or newer (sgl_kernel.utils.is_arch_support_pdl)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9


def apply_rope_with_cos_sin_cache_inplace(
        positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
        cos_sin_cache: torch.Tensor, is_neox: bool = True,
        fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
        enable_pdl: bool | None = None, *, check_positions_on_host: bool = True,
        check_cache_loc_on_host: bool = True) -> None:
    """Rotate ``query`` ``[nnz, Hq * head_size]`` and ``key`` ``[nnz, Hk * head_size]`` in place.

    ``positions``: ``[nnz]`` (taken as int64); ``cos_sin_cache``: fp32 ``[max_seq_len, R]``,
    cos in the first R/2 columns and sin in the last (R is the rotated width); ``is_neox``: pairs
    ``(i, i + R/2)``, else ``(2i, 2i + 1)``. With ``fused_set_kv_buffer_arg`` the rotated key and
    the value are also stored at rows ``cache_loc`` of its KV buffers. Head sizes 64, 128, 256,
    512; others go to :func:`rotary_embedding`. ``check_positions_on_host`` /
    ``check_cache_loc_on_host`` (added, keyword-only): read the range of ``positions`` /
    ``cache_loc`` on the host and refuse one outside the cache / the buffers (a sync the
    original does not have); False leaves the call the original's work, and the kernel gives
    such a token NaN / skips its store.

    >>> apply_rope_with_cos_sin_cache_inplace(pos, q, k, 128, cache)  # doctest: +SKIP
    """
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    if enable_pdl is None:
        enable_pdl = is_arch_support_pdl(query.device if query.is_cuda else None) and (
            fused_set_kv_buffer_arg is not None)
    a = fused_set_kv_buffer_arg
    if a is not None:
        if a.k_scale is not None or a.v_scale is not None:
            raise NotImplementedError("k_scale and v_scale are not yet supported (as upstream)")
        if a.cache_loc.dtype != torch.int64:
            raise TypeError(f"cache_loc must be int64, got {a.cache_loc.dtype}")
    q3, k3 = _view_3d(query, head_size), _view_3d(key, head_size)
    apply_rope_pos_ids_cos_sin_cache(
        q3, k3, q3, k3, cos_sin_cache, positions.long(), not is_neox, bool(enable_pdl),
        _view_3d(a.value, head_size) if a is not None else None,
        _view_3d(a.k_buffer, head_size) if a is not None else None,
        _view_3d(a.v_buffer, head_size) if a is not None else None,
        a.cache_loc if a is not None else None, check_positions_on_host=check_positions_on_host,
        check_cache_loc_on_host=check_cache_loc_on_host)


__all__ = ["UPSTREAM", "FusedSetKVBufferArg", "apply_rope_with_cos_sin_cache_inplace",
           "apply_rope_pos_ids_cos_sin_cache", "rotary_embedding", "is_arch_support_pdl",
           "check_positions", "check_cache_loc"]
