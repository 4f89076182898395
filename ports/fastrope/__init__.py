"""The study's own RoPE kernel: the best idea of each ported design, in one CuPy RawKernel.

This family is ours, not a port (no upstream). Each idea and where it came from
(README "The study's kernel" gives what each was worth, measured by switching it off):

* 16-byte loads and stores (apex and Paddle V1 lose time to scalar and 2-element accesses;
  LeetCUDA's ``f32x4_pack`` and OneFlow's interval packs show the win): worth up to 2x;
* rotate-half threads own one half and load their partner, as inductor's kernel does (full-row
  coalesced stores; BOTH_HALVES, a thread per pair of chunks, is the ablation);
* cos/sin once per token, reused across every head of q and k (seed 002's batch-reuse Triton
  kernel reuses them across the batch; apex re-reads them per element);
* several heads per thread, all loads issued before any math (independent work per thread);
* a launch shape from the problem size: decode steps split heads across blocks to cover the SMs,
  prefill shapes give each thread more heads (Paddle V1 sizes its grid from the SM count);
* no integer division: the grid (tokens, sequences, head splits) and block (chunks, head lanes,
  tokens) give every index directly (OneFlow and Paddle divide per element);
* q and k, with different head counts, in one launch (Paddle V1's q/k/v in one launch);
* fp32 math with one rounding at the store (Kahan's FMA product sum for fp32 outputs); computed
  angles in fp64 (``pos * inv_freq`` exactly, then ``sincos``), once per token in shared memory,
  so long positions stay accurate (OneFlow's half-precision and apex's fp32 angles lose the
  rotation at long positions) and no data load waits on a table;
* 32-bit offsets when they fit, 64-bit otherwise (apex and LeetCUDA overflow int32);
* one struct argument launched through ``cuLaunchKernel``, the validated problem and its launch
  cached by input geometry: about 10 us of host time per call on an H100 host.

API::

    apply_rope(q, k=None, *, cos=None, sin=None, positions=None, offsets=None,
               cu_seqlens=None, max_seqlen=None, style="rotate_half", layout="bshd",
               rotary_dim=None, base=10000.0, inv_freq=None, check_positions=True)
    apply_rope_inplace(q, k=None, **same)

Both are autograd-aware (the backward is the same kernel rotating by -theta). ``apply_rope``
returns new contiguous tensors (q's rotated, or ``(q, k)``); ``apply_rope_inplace`` rotates q
(and k) in place and returns them.
"""
from __future__ import annotations

from ports.fastrope.api import MODULE, apply_rope, apply_rope_inplace

__all__ = ["MODULE", "apply_rope", "apply_rope_inplace"]
