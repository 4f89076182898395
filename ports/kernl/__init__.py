"""kernl's ``rbe_triton`` (seed 004): interleaved RoPE with frequencies computed in the kernel.

Upstream: seed document 004 (kernl blog "Deep Dive into Kernel Fusion: Accelerating Inference in
Llama V2") and its project code ``ELS-RD/kernl@da9db806:experimental/llama-v2/kernel/
fused_kernel_proj_qkv.py`` (``rbe_triton``, ``get_freq_multi_tokens``, ``rbe_triton_wrapper``).
An independent re-implementation of that design, not a copy.

Design kept:

* ``x`` is ``[batch, M, K]``: M tokens, ``K = heads * head_dim`` channels flattened (Llama's
  projection output before ``.view(batch, M, heads, head_dim)``); three strides each for x and out.
* Grid ``(batch, cdiv(M, BLOCK_SIZE_M) * cdiv(K, BLOCK_SIZE_K))``; a program rotates a tile of
  ``BLOCK_SIZE_M`` tokens by ``BLOCK_SIZE_K`` channels, loading even (real) and odd (imag)
  channels separately with masks ``n < K`` and ``n + 1 < K``. Defaults as upstream's wrapper:
  ``BLOCK_SIZE_M=2``, ``BLOCK_SIZE_K=1024``.
* Frequencies on the fly, fp32: ``f = THETA ** ((n % head_dim) / head_dim)`` for the even channel
  ``n``; angle ``= position / f`` with positions ``start_token_position + m`` (``THETA`` a
  ``tl.constexpr``, ``start_token_position`` and M, K runtime ints: a new sequence length does not
  recompile). Interleaved convention: ``out_real = r cos - i sin``, ``out_imag = r sin + i cos``.
* Out of place; forward only (upstream has no backward: it is an inference kernel).

Departures:

* ``head_dim`` is a ``tl.constexpr`` argument (``HEAD_DIM``); upstream hard-codes ``DIM = 128``
  in ``get_freq_multi_tokens`` ("in model, dim = params.dim // n_heads").
* ``THETA ** e``: libdevice ``pow`` (what ``tl.math.pow`` lowered to in 2023 Triton) on a GPU; the
  Triton interpreter has no libdevice, so there ``exp2(e * log2(THETA))`` (``LIBDEVICE_POW`` is a
  constexpr flag set by the wrapper).
* Program ids and token offsets are int64 before pointer arithmetic: int32 offsets wrap once a
  tensor passes 2^31 elements.
* The ``tl.debug_barrier()`` calls are dropped from the standalone kernel (out of place, nothing
  is re-read); the fused kernel keeps its barrier, which its in-place epilogue needs.
* Host checks before launch (``TypeError`` dtypes, ``ValueError`` shapes/devices/sizes), an
  optional caller-provided ``out`` (any strides), a device guard; upstream only asserted.
"""
from ports.kernl.fused import (
    rms_matmul_rbe, rms_matmul_rbe_qkv, rms_matmul_rbe_qkv_wrapper, rms_matmul_rbe_wrapper,
    rmsnorm_triton, rmsnorm_triton_wrapper,
)
from ports.kernl.rbe import UPSTREAM, get_freq_multi_tokens, rbe_triton, rbe_triton_wrapper

__all__ = ["rbe_triton", "rbe_triton_wrapper", "get_freq_multi_tokens", "UPSTREAM",
           "rmsnorm_triton", "rmsnorm_triton_wrapper", "rms_matmul_rbe", "rms_matmul_rbe_wrapper",
           "rms_matmul_rbe_qkv", "rms_matmul_rbe_qkv_wrapper"]
