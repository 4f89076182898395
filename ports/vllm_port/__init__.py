"""vLLM's rotary embedding CUDA op, ported as a CuPy RawKernel: ``rotary_embedding``.

Upstream:
``vllm-project/vllm@0f5257e245116449bfbe78a87c22aeef632eba8f:csrc/pos_encoding_kernels.cu``
(kernel and host function; Apache-2.0), the op behind ``vllm._custom_ops.rotary_embedding``.
Written anew from the design, not copied. The package is ``ports.vllm_port`` (rows
``vllm_port.*``, family ``vllm_port``) so that neither its import path nor its row names can be
read as the installed ``vllm`` package, whose op is the peer row ``vllm.rotary_embedding``
(:mod:`ports.peers.canonical`).

What the original does, kept here:

* in place on ``query`` ``[T, h * d]`` / ``[T, h, d]`` (or ``[b, s, ...]`` with positions
  ``[b, s]``) and an optional ``key`` with fewer heads (GQA; ``None`` rotates q alone);
* positions int64 per token; ``cos_sin_cache`` ``[max_position, rot_dim]``, each row the cos half
  then the sin half (one value per pair), in fp32, fp16 or bf16 independently of query's dtype;
* NeoX (``is_neox=True``: pairs ``(i, i + rot_dim/2)``) and GPT-J (pairs ``(2i, 2i+1)``);
  partial rotary (``rot_dim < head_size``) with the rotated part at ``rope_dim_offset``;
  ``inverse`` rotates by minus the angle (the kernel's two later arguments, kept as defaults);
* token stride (the positions' last dim's stride of query and of key) and head stride (query's
  ``stride(-2)`` for ``[.., h, d]``, ``head_size`` for ``[.., h * d]``);
* grid ``(T)``, block ``min(h * rot_dim / 2, 512)``; each thread strides over (q head, pair), then
  over (k head, pair); cos/sin through ``__ldg``; fp32 math ``x*cos - y*sin`` and
  ``y*cos + x*sin``, one rounding to query's dtype at each store; int64 token and head offsets.

Departures, each refusing an input the original would mishandle (ValueError/TypeError before
any launch), or bounding one it would read out of bounds:

* positions outside ``[0, max_position)`` (the original reads past ``cos_sin_cache``): refused by a
  host check that reads the positions (an ``aminmax`` launch and one device-to-host copy that waits
  for the stream: tens of microseconds, more than a decode step's whole kernel;
  ``check_positions_on_host=False`` skips it for trusted positions). While the current stream
  captures a CUDA graph the check is skipped (a capture allows no sync), and the kernel's own bound
  applies instead: it takes ``max_position`` and writes NaN to the rotated channels of a token whose
  position is out of range, so a bad position is visible and never a stray read;
* positions must be int64 and contiguous, ``cos_sin_cache`` contiguous and 2-D (the kernel reads
  both densely whatever their strides), ``rot_dim`` even and > 0;
* key must have query's dtype, and (with more than one head) query's head stride (the kernel steps
  key's heads by query's head stride); the last dim of query and key must be contiguous;
* with ``[b, s, ...]`` tensors the batch stride must be ``s`` x the seq stride (the kernel walks
  token ``b*s + i`` with the seq stride alone);
* a key with 0 heads is refused (the original divides by zero); empty inputs return at once (the
  original divides by the token count, and launches an empty block for 0 heads);
* ``VLLM_LDG`` is ``__ldg``; torch's Half/BFloat16 are ``__half``/``__nv_bfloat16`` (same bits and
  round-to-nearest-even conversions).

The same commit's fused QK-norm + RoPE op, ``fused_qk_norm_rope``, is ported beside it in
:mod:`ports.vllm_port.qknorm` (its own header and departures), and re-exported here.

Not ported: ``batched_rotary_embedding`` (per-token ``cos_sin_cache_offsets`` into a cache of
several scalings, once used for multi-LoRA long context) does not exist in the pinned file, so
there is no batched or offset variant to port at this sha.
"""
from __future__ import annotations

import torch

from ports.vllm_port._launch import block_size, check_positions, rotary_embedding as _rotary

UPSTREAM = ("vllm-project/vllm@0f5257e24511:csrc/pos_encoding_kernels.cu "
            "(vllm._custom_ops.rotary_embedding)")


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool,
                     rope_dim_offset: int = 0, inverse: bool = False, *,
                     check_positions_on_host: bool = True) -> None:
    """vLLM's ``rotary_embedding`` op: rotate ``query`` and ``key`` in place; returns None.

    Parameters
    ----------
    positions
        int64 ``[T]`` or ``[b, s]``, contiguous; each in ``[0, max_position)``.
    query
        ``[T, h * d]``, ``[T, h, d]``, or ``[b, s, ...]`` of the same two forms; fp32, fp16 or
        bf16; any token/head strides, last dim contiguous. Rotated in place.
    key
        ``None`` or like query with ``h_k`` heads (``h % h_k == 0``), query's dtype. In place.
    head_size
        ``d``.
    cos_sin_cache
        ``[max_position, rot_dim]``, contiguous, fp32/fp16/bf16: row ``p`` is
        ``cos(p * w_0 .. p * w_{rot_dim/2-1})`` then ``sin(...)``.
    is_neox
        True: pairs ``(i, i + rot_dim/2)``; False (GPT-J): pairs ``(2i, 2i+1)``.
    rope_dim_offset, inverse
        The rotated channels start at ``rope_dim_offset``; ``inverse`` rotates by minus the angle.
    check_positions_on_host
        Refuse out-of-range positions before launch (a device sync; skipped during CUDA-graph
        capture, where the kernel writes NaN for them instead).

    Example
    -------
    >>> rotary_embedding(pos, q, k, 128, cache, True)  # doctest: +SKIP
    """
    _rotary(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset, inverse,
            check_positions_on_host=check_positions_on_host)


from ports.vllm_port.qknorm import fused_qk_norm_rope  # noqa: E402  (the fused QK-norm op)

__all__ = ["UPSTREAM", "block_size", "check_positions", "fused_qk_norm_rope", "rotary_embedding"]
