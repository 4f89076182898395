"""FlashInfer's fused QK RMSNorm + 3-D RoPE, ported as a CuPy RawKernel: ``fused_qk_rmsnorm_rope``.

Upstream:
``flashinfer-ai/flashinfer@fb28d7242b35:include/flashinfer/norm/fused_qk_rmsnorm_rope.cuh``
(kernel and launcher), ``csrc/norm.cu`` (``fused_qk_rmsnorm_rope_run``: the binding's checks) and
``flashinfer/norm/__init__.py`` (the Python API: checks, output allocation, defaults), exported
as ``flashinfer.fused_qk_rmsnorm_rope`` and ``flashinfer.diffusion_ops.fused_qk_rmsnorm_rope``.
Apache-2.0; written anew from the original, keeping its structure
(``fused_qk_rmsnorm_rope.cu`` beside this file). Forward only, as upstream.

This is FlashInfer's only fused QK-norm + RoPE kernel at the pinned commit, and it is not the
per-head norm of Qwen3 and Gemma3: it was written for video diffusion transformers (WAN).

* The norm is over all heads of a token (OLMo2's form): ``rsqrt(sum over hq * head_dim
  channels / (hq * head_dim) + eps)``, weights ``[hq * head_dim]`` and ``[hk * head_dim]``;
  ``is_qk_norm=False`` skips it. After the weight, the value is rounded to bf16 and back (to
  match an unfused bf16 pipeline), unless the output is FP8.
* RoPE is 3-D: the token's index ``i`` in its sequence of ``ppf * pph * ppw`` patches gives
  positions ``(i // (pph*ppw), i % (pph*ppw) // ppw, i % ppw)``; the head's channels are split
  into frame, height and width sections, each rotated by its position with frequencies
  ``base^(-2j / section channels)`` (YaRN-blended when ``factor != 1``, then times
  ``attention_factor``); angles through ``__sincosf`` (fast math). ``interleave`` True: pairs
  ``(2j, 2j+1)``; False: NeoX halves, exchanged across lanes 16 apart. With ``pph = ppw = 1``
  and the frame section the whole head, it is the usual 1-D RoPE at positions ``0..ppf-1``.
* ``qkv`` bf16, contiguous, ``[b, s, (hq + hk + hv) * head_dim]`` or ``[tokens, ...]``; outputs
  are separate contiguous ``q_out``, ``k_out``, ``v_out`` (``[b, s, h, d]`` or ``[tokens, h,
  d]``), bf16 or FP8 E4M3 (``output_fp8``, with scales); v is copied (or quantized).
* Launch: grid ``(tokens, 3)`` (q, k and v blocks), block ``max(hq, hk, hv)`` warps, one warp a
  head, ``head_dim / 32`` channels a lane as one vector; head_dim 64, 128 or 256; at most 32
  heads; int64 token offsets.

Departures:

* every check raises an exception: the launcher's ``FLASHINFER_FUSED_CHECK`` aborts the process
  (0 tokens, ``attention_factor != 1`` without YaRN); 0 tokens or no heads return the outputs at
  once;
* qkv's device is checked last (the original checks it first), so every other refusal is named
  on any device;
* added: qkv's last dim must be ``(hq + hk + hv) * head_dim`` (the original reads rows of that
  size whatever the tensor's); outputs must not overlap qkv or each other (blocks read qkv
  while others write); qkv, the weights and the outputs must be aligned for the lanes' vectors;
* the frequency table (``[head_dim / 2]`` fp32, the same fp32 formula) is built on the host by
  NumPy and cached per device and parameters, as the original caches its table;
* ``IntFastDiv``'s magic-number division is plain int division (the same quotients here).
"""
from __future__ import annotations

import torch

from ports.flashinfer_port._qknorm_launch import fused_qk_rmsnorm_rope as _fused

UPSTREAM = ("flashinfer-ai/flashinfer@fb28d7242b35:include/flashinfer/norm/"
            "fused_qk_rmsnorm_rope.cuh (flashinfer.fused_qk_rmsnorm_rope)")


def fused_qk_rmsnorm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, *,
                          ppf: int, pph: int, ppw: int, num_frame_channels: int,
                          num_height_channels: int, num_width_channels: int, num_heads_q: int,
                          num_heads_k: int, num_heads_v: int, head_dim: int, eps: float = 1e-6,
                          base: float = 10000.0, interleave: bool = True, factor: float = 1.0,
                          low: float = 0.0, high: float = 0.0, attention_factor: float = 1.0,
                          is_qk_norm: bool = True, output_fp8: bool = False,
                          output_quant_scale: float = 1.0, v_quant_scale: float = 1.0,
                          q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
                          v_out: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's ``fused_qk_rmsnorm_rope``: across-heads RMSNorm + 3-D RoPE of q and k, v
    copied; returns ``(q_out, k_out, v_out)``.

    Parameters
    ----------
    qkv
        bf16, contiguous: ``[batch, seq_len, (hq + hk + hv) * head_dim]`` with ``seq_len = ppf *
        pph * ppw``, or ``[num_tokens, ...]`` with ``num_tokens`` a multiple of it. Not changed.
    q_weight, k_weight
        bf16, contiguous, ``[hq * head_dim]`` and ``[hk * head_dim]``.
    ppf, pph, ppw
        Patches along frame, height and width.
    num_frame_channels, num_height_channels, num_width_channels
        Even channel counts of the three RoPE sections, summing to ``head_dim``.
    num_heads_q, num_heads_k, num_heads_v, head_dim
        Head counts (each at most 32) and head size (64, 128 or 256).
    eps, base, interleave
        RMSNorm epsilon; RoPE base; True: pairs ``(2j, 2j+1)``, False: NeoX halves.
    factor, low, high, attention_factor
        YaRN (``factor == 1``: off, and ``attention_factor`` must be 1).
    is_qk_norm
        False: RoPE only.
    output_fp8, output_quant_scale, v_quant_scale
        FP8 E4M3 outputs, ``x * scale`` saturated.
    q_out, k_out, v_out
        Optional preallocated outputs (shape as returned, contiguous, not overlapping qkv).

    Example
    -------
    >>> q, k, v = fused_qk_rmsnorm_rope(qkv, qw, kw, ppf=s, pph=1, ppw=1,  # doctest: +SKIP
    ...     num_frame_channels=128, num_height_channels=0, num_width_channels=0,
    ...     num_heads_q=32, num_heads_k=8, num_heads_v=8, head_dim=128, interleave=False)
    """
    return _fused(qkv, q_weight, k_weight, ppf=ppf, pph=pph, ppw=ppw,
                  num_frame_channels=num_frame_channels, num_height_channels=num_height_channels,
                  num_width_channels=num_width_channels, num_heads_q=num_heads_q,
                  num_heads_k=num_heads_k, num_heads_v=num_heads_v, head_dim=head_dim, eps=eps,
                  base=base, interleave=interleave, factor=factor, low=low, high=high,
                  attention_factor=attention_factor, is_qk_norm=is_qk_norm,
                  output_fp8=output_fp8, output_quant_scale=output_quant_scale,
                  v_quant_scale=v_quant_scale, q_out=q_out, k_out=k_out, v_out=v_out)


__all__ = ["UPSTREAM", "fused_qk_rmsnorm_rope"]
