"""``qk_norm_rope``: per-head RMSNorm of q and k, then RoPE, fused in one Triton launch, with a
fused backward (dq, dk, dq_weight, dk_weight) in one more.

Qwen3 and Gemma3 attention normalise each head of q and k with an RMSNorm of ``head_dim``
weights right before the rotary embedding (OLMo2 normalises all heads of a token together:
``norm="token"``). Unfused, that is four passes over q and k (norm read
and write, RoPE read and write); fused, two: read once, write once. Forward and backward both
keep the math in fp32 and round once, at the store (the kernels: :mod:`.qknorm_kernels`).

API::

    qk_norm_rope(q, k, q_weight, k_weight, eps, *, cos=None, sin=None, positions=None,
                 style="rotate_half", layout="bshd", rotary_dim=None, base=10000.0,
                 gemma=False, check_positions=True, norm="head") -> (q_out, k_out)
    qk_norm_rope_inplace(q, k, q_weight, k_weight, eps, **same) -> (q, k)

Support matrix
--------------
============== ===========================================================================
dtypes         q, k: float32, float16, bfloat16 (the same); weights: any of the three
               (their own dtype; dweight comes back in it); cos/sin: any of the three
layouts        bshd, sbhd, bhsd: any strides; thd ``[t, h, d]`` with ``positions`` only
heads          k may have fewer heads than q (GQA, MQA); head_dim <= 1024
styles         rotate_half (pairs ``(i, i + R/2)``), interleaved (``(2i, 2i + 1)``)
rotary_dim     even, <= head_dim; channels R..D-1 are normalised, not rotated
angles         cos/sin ``[L, R]`` (each member's own value; the two may differ) or
               ``[L, R/2]``; or none: ``pos * base^(-2j/R)`` and cos/sin in fp64 in the kernel
positions      None (token i of each sequence at i) or int32/int64 ids ``[b, s]``/``[s]``
               (thd: ``[t]``)
norm           ``x * rsqrt(mean(x^2) + eps) * w``; ``gemma=True``: ``* (1 + w)``;
               ``norm="head"``: per head, weights ``[head_dim]``; ``norm="token"`` (OLMo2):
               over each token's heads together, weights ``[heads * head_dim]``
autograd       dq, dk, dq_weight, dk_weight; weight gradients deterministic (see below)
torch          custom ops ``torch.ops.fastrope.qk_norm_rope`` (+ ``_backward``) and
               ``qk_norm_rope_``, fake implementations, ``torch.compile(fullgraph=True)``
============== ===========================================================================

Refused with an exception, before any launch: per-sequence ``offsets`` and thd's
``cu_seqlens`` (not taken: pass per-token ``positions``); thd without positions
(``NotImplementedError``); ``qk_norm_rope_inplace`` while a gradient is recorded (its backward
needs the input it overwrites: ``NotImplementedError``); q and k sharing memory in place.

Precision, and how it differs from transformers
-----------------------------------------------
Everything between the load and the store is fp32: ``sum(x^2)``, ``rstd``, ``x * rstd * w``
and the rotation; the output is rounded once. transformers rounds more often:

* Qwen3RMSNorm (and Llama's): ``x.float() * rsqrt(...)``, rounded to the input dtype, *then*
  times the weight (in the weight's dtype: a second rounding in bf16 models), then RoPE in the
  input dtype with cos/sin rounded to it (three more roundings);
* Gemma3RMSNorm and Olmo2RMSNorm: ``(x_hat * w).to(dtype)``, one rounding, then RoPE's three.

So in fp16/bf16 this kernel's outputs are closer to the float64 oracle than transformers' own,
and differ from them by up to a few output ulps; in fp32 the two agree to a few fp32 ulps.

Norm over all heads of a token (OLMo2)
--------------------------------------
OLMo2 normalises q and k over all heads of a token at once (a ``num_heads * head_dim``
weight): ``norm="token"``. Its kernels (``qk_token_norm_rope_*``) give a program every head of
one tensor for its token (forward) or its tokens (backward). The forward takes a token's heads
whole where they fit one block (``TOKEN_FWD_WHOLE_ELEMENTS``): each row read once and kept in
registers, the weight loaded first, and q and k in one program where the GPU's table says so
(``TOKEN_FWD_QK_TOGETHER``) or there are fewer tokens than SMs; above that it reads them in
blocks of heads twice, once for the token's sums, once to write. The grid is tokens x 2 (q, k)
or tokens x 1 (together), so a decode step of a few tokens has only a few programs.
The backward takes a token's heads whole where they fit one block
(``TOKEN_BWD_WHOLE_ELEMENTS``): one pass, each row read once, 2.8x faster than two passes at
Qwen3-8B's 4k tokens and 1.4x at 4 x 4k (H100); where the rows allow it (``TOKEN_BWD_TMA``) it
reads them through TMA descriptors, later tokens' rows waiting in shared memory, and in 16 bits
a token's q and k in one program (``TOKEN_BWD_TMA_QK_TOGETHER``). Above that it
keeps each token's ``rstd`` and ``mean(dx_hat * x_hat)`` in registers between two passes over
blocks of heads. Its weight gradient's partial rows are
``[programs, heads * head_dim]``: ``8 / (3 * tokens_per_program * itemsize)`` extra bytes, about
8% at 16 tokens a program in bf16.

Deterministic weight gradients
------------------------------
Each backward program sums ``dz * x_hat`` over its heads and its group of tokens in registers
and writes one fp32 row of a ``[programs, head_dim]`` buffer; one more launch
(:func:`weight_grads`) sums the rows of q's and k's buffers in a fixed order and rounds once to
the weights' dtype. Cost: the buffer's write and read, ``2 * 4 * head_dim`` bytes per program,
against the ``3 * heads * head_dim * itemsize`` bytes the program moves for dx: about
``8 / (3 * heads_per_block * tokens_per_program * itemsize)`` extra (0.5% at head_dim 128 in
bf16: 16 heads and 16 tokens a program), plus the reduction's launch (1.6-1.7 us on the H100 at
Qwen3-8B's heads from 4k to 32k tokens; a ``torch.sum`` and a cast per weight took 12-15 us in
four launches). The group's size follows the grid (:func:`backward_tokens_per_program`): one
token a program while the grid is small (parallelism first), so the row count never exceeds
``BACKWARD_PROGRAMS_PER_SM`` per SM once there are more tokens.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ports import _alloc, _triton
from ports.fastrope import qknorm_kernels as K
from ports.fastrope import tuning
from ports.fastrope.plan import sm_count
from ports.fastrope.problem import check_input, dtype_name, geometry
from reference import tables
from reference.qk_norm import NORMS
from reference.vocabulary import (BSH_AXES, INDEX_DTYPES, KERNEL_TORCH_DTYPES,
                                  LAYOUTS, STYLES)

NAMESPACE = "fastrope"
MAX_HEAD_DIM = 1024        # one head row held in registers
# The per-head forward's block (heads per program * head_dim) and warps: 512 elements, one
# warp (16 elements a thread), with a token's head blocks adjacent in the grid. Swept on the H100
# at Qwen3-8B's 32/8 heads of 128, bf16 (tools/qknorm_launch_sweep.py, results/README.md,
# 2026-11-27): the fastest out of place at 4096, 4 x 4096 and 32768 tokens (28.5, 112.2, 234.9 us
# against 31.2, 116.5, 257.1 at 2048 elements and 4 warps), in place within 1% of the fastest.
# The H200 wants 1024 elements on one warp (its table sets them): 512 moved Qwen3-8B's q and k
# there at 80% of a same-size copy, 1024 at 93-97% (27.0 -> 23.1 us at 4k tokens, 101.3 -> 82.9
# at 4 x 4k, 200.7 -> 170.4 at 32k); on the H100 1024 takes 30.9 against 28.7 us at 4k.
HEAD_FWD_BLOCK_ELEMENTS = 512
HEAD_FWD_WARPS = 1
# The token-norm forward takes a token's heads whole, read once, where they fit
# TOKEN_FWD_WHOLE_ELEMENTS (heads and head_dim padded to powers of two), on a warp per
# TOKEN_FWD_ELEMENTS_PER_WARP of the rows a program holds (q's and k's where they are together:
# 32 + 8 heads of 128 on 2 warps), half that where the channels are strided; above that it
# reads them twice, in blocks of TOKEN_FWD_BLOCK_ELEMENTS on TOKEN_FWD_WARPS (16 elements a
# thread; not swept), and so do angles computed in the kernel: their fp64 cos/sin made the
# one-pass kernel spill 1072 bytes of registers on sm_90 under Triton 3.6 (fp16, 2 warps, 32
# heads of 96). Before the weights came first and q and k shared a program, swept on the
# H100 at Qwen3-8B's 32/8 heads of 128, bf16, out of place (tools/qknorm_launch_sweep.py
# --direction token-forward, results/README.md, "OLMo2's norm forward in one pass"): two passes
# took 3.1, 37.8, 141.5 and 282.4 us at 64, 4096, 4 x 4096 and 32768 tokens; whole tokens at
# 2048 elements a warp (2 warps, fewer warps a program and more programs an SM) 2.3, 35.7, 130.2
# and 260.0, at 1024 2.3, 37.9, 142.8 and 285.9, at 512 2.5, 42.9, 163.8 and 330.5. The elements
# a warp are a device-tuned constant (DEVICE_TUNED; results/README.md, "OLMo2's norm: the
# forward's warps by GPU"). From full-width tables, with q and k together, the H200 moved
# Qwen3-8B's 4k, 4 x 4k and 32k tokens out of place in 27.4, 98.2 and 190.0 us on one warp (4096;
# 255 registers, 8 programs an SM) against 28.6, 102.3 and 198.4 on two (2048; 168 registers, 6
# programs an SM). From the suite's half-width tables its `tune --qknorm` (1355f18) took q and k
# apart at 2048 instead: 26.2, 93.2 and 186.7 us against 28.7, 103.5 and 201.1 together at 4096
# (TOKEN_FWD_QK_TOGETHER below). On the H100 2048 together stays (9cb1a4c: apart at 2048 0.993x,
# together at 4096 1.038x, at 1024 1.111x; margin 1%).
TOKEN_FWD_WHOLE_ELEMENTS = 8192
TOKEN_FWD_ELEMENTS_PER_WARP = 2048
# More warps where a thread of the one-pass forward would hold more of a token's elements than
# TOKEN_FWD_MOST_ELEMENTS_A_THREAD, by (the rows' element size, the weights'), or than
# TOKEN_FWD_MOST_STRIDED_ELEMENTS_A_THREAD where the channels are strided (each element's own
# address register): the most that compile without a register spill on sm_90 (Triton 3.6 and
# 3.8, q and k together, half and full tables). 16-bit rows and weights: 160 (32 + 8 heads of 128
# on one warp, 255 registers); 192 (32 + 16 heads) spilled 152 bytes. 16-bit rows, fp32 weights
# (a bf16 model's activations under autocast, its weights fp32): 128; 160 spilled up to 102
# bytes. fp32 rows: 96 (32 + 16 heads on two warps, 250 registers); 160 spilled 64 bytes.
# Strided: 48; 64 (fp16, 32 heads of 96 on two warps) spilled 52 bytes under Triton 3.8. 2048
# elements a warp stays within all of them (at most 96 a thread, 48 strided); 4096 would put
# 32 + 16 heads of 128 on one warp.
TOKEN_FWD_MOST_ELEMENTS_A_THREAD = {(2, 2): 160, (2, 4): 128, (4, 2): 96, (4, 4): 96}
TOKEN_FWD_MOST_STRIDED_ELEMENTS_A_THREAD = 48
# Interleaved pairs with an unrotated tail hold at most this many: 16-bit rows and weights at 160
# (32 + 8 heads of 96, 48 of them rotated, on one warp: 4096 elements a warp) spilled
# 204-252 bytes on sm_90 under Triton 3.6 (fp16 and bf16, half and full tables); at 128 (16 + 16
# heads on one warp) none did.
TOKEN_FWD_MOST_INTERLEAVED_TAIL_ELEMENTS_A_THREAD = 128
# At most this many elements a warp where there are fewer tokens than SMs (decode): the grid then
# leaves SMs idle, and a token's work on more warps ends sooner. H100, Qwen3-8B's heads, bf16, q
# and k together (tools/qknorm_launch_sweep.py, dba9ee4), 1 / 64 tokens out of place: 1024 1.9 /
# 2.1 us, 512 2.0 / 2.2, 2048 2.1 / 2.3, 4096 2.8 / 3.0; at 1k tokens (7.8 an SM) 4096 was the
# fastest (6.2 us, 2048 6.8, 1024 7.6). The H200's qknorm suite took 2.9 us at 64 tokens on the
# 4096 its table then set (5c2438a) against 2.2 on 2048 (6d5d1ba). There q and k also go together
# in one program whatever the table says (token_forward_launch): on the H200, whose table takes them
# apart, 1 / 64 tokens took 1.8 / 2.0 us together against 1.9 / 2.1 apart at 1024 a warp, 1.9 / 2.0
# against 2.0 / 2.2 at 512 (tools/qknorm_launch_sweep.py, e300dd7).
TOKEN_FWD_FEW_TOKENS_ELEMENTS_PER_WARP = 1024
TOKEN_FWD_BLOCK_ELEMENTS = 2048
# The backward holds x, dy, the weight and the partial sums: a quarter of the forward's block
# (at 1024 an fp32 head of 96 channels, padded to 128, spilled registers on sm_90). This is the
# token-norm backward's; the per-head backward's is HEAD_BWD_BLOCK_ELEMENTS.
TOKEN_BWD_BLOCK_ELEMENTS = 512
# Where every head of a token fits TOKEN_BWD_WHOLE_ELEMENTS (heads and head_dim padded to powers
# of two), the token-norm backward takes each token whole, in one pass that reads its rows once,
# on a warp per TOKEN_BWD_ELEMENTS_PER_WARP and at least BACKWARD_WARPS: 8 warps for Qwen3-8B's
# 32 heads of 128. Two passes over blocks of heads (TOKEN_BWD_BLOCK_ELEMENTS) read a program's
# tokens twice, the second time from DRAM once the resident programs' tokens outgrow the L2.
# Swept on the H100 at Qwen3-8B's 32/8 heads, bf16, 16 tokens a program
# (tools/qknorm_launch_sweep.py --direction token-backward, results/README.md, "OLMo2's norm
# backward in one pass"): two passes took 247.7 us at 4096 tokens and 438.4 at 4 x 4096, one pass
# 88.9 and 307.8 at 512 elements a warp, 117.4 and 414.6 at 256. 1024 (4 warps) took 85.3 and
# 292.6 but spills 560 bytes of registers on sm_90 (the kernels compile without spills:
# tests/test_qknorm.py); 2 pipelining stages were slower; 8 tokens a program 4-5% slower, 32 up
# to 3% faster (not taken: half the programs at 1k tokens, where it was not measured).
TOKEN_BWD_WHOLE_ELEMENTS = 8192
TOKEN_BWD_ELEMENTS_PER_WARP = 512
TOKEN_BWD_STAGES = 1  # the whole-token loop's software-pipelining stages
# Whole tokens read through TMA descriptors where the rows allow it (rotate-half, no tail, a
# power-of-two half of at least 16 bytes, blocks of at least 1 KB, 16-byte aligned rows, tokens
# ordered batch-major: bshd or thd; angles from tables; Hopper or later, or the interpreter) and a
# program gets more than one token: in TOKEN_BWD_TMA_STAGES pipelining stages later tokens' rows
# wait in shared memory instead of registers, so more of the stream is in flight. Tokens a
# program: as many as spread them over the SMs, at most TOKEN_BWD_TMA_TOKENS; a
# warp per TOKEN_BWD_TMA_ELEMENTS_PER_WARP (by element size). Swept on the H100 and the H200 at
# Qwen3-8B's 32/8 heads, bf16, full tables (tools/qknorm_launch_sweep.py --direction
# token-backward-tma, results/README.md, "OLMo2's norm backward on 4 warps, its tokens spread
# over the SMs"): plain loads 79.5, 297.2 and 590.1 us at 4k, 4 x 4k and 32k tokens (H100); 4
# warps, 3 stages, at most 512 tokens 56.3, 198.0 and 400.2 (77-85% of a copy); at most 32
# tokens 56.6, 225.2 and 448.1; 8 warps 62.5, 228.8 and 448.9; 2 stages slower everywhere, 4 no
# faster. The H200 chose the same. fp32 rows keep 8 warps: on 4 (sm_90, Triton 3.6) 217-225
# registers in the compile test's build, and 4 bytes spilled where the strides are known
# divisible by 16.
TOKEN_BWD_TMA = True
TOKEN_BWD_TMA_TOKENS = 512
# The tokens are spread over this many programs an SM: a q and a k program where they are apart
# (more, shorter pipelines were slower on the H200, results/README.md, "OLMo2's norm through TMA:
# tried and dropped": 2 q programs an SM took 56.1, 185.1 and 360.8 us at 4k, 4 x 4k and 32k
# tokens against 1's 49.8, 175.3 and 345.4), two programs of both where they are together.
TOKEN_BWD_TMA_PROGRAMS_PER_SM = 2
# Through TMA, a token's q and k in one program (1; grid: token groups, the tokens spread evenly,
# any count a program) or in a program each (0; grid: token groups x 2, a power of two tokens a
# program), by element size. Together the angles come once a token, and each SM runs two
# programs of the same length, where apart k's program (a quarter of q's bytes at Qwen3-8B's
# 32/8 heads) ends early and leaves q's alone. tools/qknorm_launch_sweep.py --direction
# token-backward-tma (results/README.md, "OLMo2's norm backward: q and k in one program"), bf16,
# 4k, 4 x 4k and 32k tokens: H100 (one run, 6d5d1ba) 57.3, 196.8 and 379.7 us together against
# 56.7, 194.3 and 398.7 apart; H200 (two runs, 1ff1e50 and 5f86fa7) 48.5, 156.2 and 303.5 against
# 48.0, 161.8 and 324.1. Apart, the even spread took 47.6, 193.4 and 378.6 (H200) and 57.2, 204.5
# and 403.7 (H100); together, a power of two 50.0, 165.9 and 323.4 (H200). fp32 stays apart:
# together its 8-warp program holds 127 KB of shared memory (sm_90, Triton 3.6), so one fits an
# SM.
TOKEN_BWD_TMA_QK_TOGETHER = {2: 1, 4: 0}
TOKEN_BWD_TMA_STAGES = 3
TOKEN_BWD_TMA_ELEMENTS_PER_WARP = {2: 1024, 4: 512}  # by element size
# The per-head backward's block by (element size, whether the head has an unrotated tail).
# 16-bit: 2048 (16 heads of 128), the fastest of the sweep (tools/qknorm_launch_sweep.py); on the
# H100 at Qwen3-8B's 32/8 heads, bf16, 16 tokens a program and 4 warps, the kernel alone took
# 76.0 us at 4096 tokens, 213.5 at 4 x 4096 and 414.6 at 32768 against 86.2, 229.9 and 449.8 at
# 1024 (results/README.md, 2026-11-27, the grid-order A/B). Without pipelining stages ptxas gave
# it 252-255 registers on sm_90 and a tail (partial rotary) spilled, so 1024 there; with 3 stages
# the loads wait in shared memory: 128 registers and 18.4 KB a program (ncu, H100). fp32 holds
# twice the registers per element: 256, the most that compiles without a spill.
HEAD_BWD_BLOCK_ELEMENTS = {(2, False): 2048, (2, True): 1024, (4, False): 256, (4, True): 256}
# The per-head backward's grid follows the device: its groups of tokens are as large as it takes
# to cut the grid to about BACKWARD_PROGRAMS_PER_SM programs per SM (one token a program below
# that): fewer weight-gradient partial rows, and no long tail of programs. The best budget is
# sharp and differs by GPU (tools/qknorm_launch_sweep.py, results/README.md, 2026-11-27; bf16,
# 2048 elements, 3 stages): on the H100 3 per SM took Qwen3-8B's heads at 4k, 4 x 4k and 32k
# tokens in 61.8, 200.5 and 388.8 us, 4 per SM in 64.7, 207.6 and 413.0; on the H200 3 took 55.1,
# 169.0 and 315.6, 4 took 55.4, 151.3 and 295.8. The H100's 3 here; the H200's table sets 4.
BACKWARD_PROGRAMS_PER_SM = 3
# The token-norm forward's whole tokens: a token's q and k in one program (1), both tensors'
# loads in flight before either's sum and half the programs, or in a program each (0), more and
# smaller programs. The weights are loaded before the rows either way. `tune --qknorm` on the
# H100 (fb50be4; Qwen3-8B's 32/8 heads of 128, bf16, out of place at 4k, 4 x 4k and 32k tokens):
# 34.1, 123.3 and 241.4 us together, 35.4, 130.0 and 259.9 apart (results/README.md, "OLMo2's
# norm forward: the weights before the rows, q and k in one program"). From the suite's
# half-width tables (`tune --qknorm`, 1355f18) the H200 takes them apart at 2048 elements a warp,
# 0.916x the time of together at 2048 (5 interleaved rounds, 6 cases); its table sets 0. The H100
# timed apart at 0.993x (9cb1a4c), within the 1% margin, and 1 serves it and a GPU without a
# table.
TOKEN_FWD_QK_TOGETHER = 1
# The launch constants a GPU family's tuning table may set for it (its "qknorm" entry, see
# ports/fastrope/tuning.py; `python -m ports.harness.tune --qknorm` writes it), where the H100
# and the H200 want different ones; the values above serve every GPU without one. Names in
# FORCED win over both (the tuning's, the launch sweep's and qknorm_bench --set's settings).
DEVICE_TUNED = ("HEAD_FWD_BLOCK_ELEMENTS", "HEAD_FWD_WARPS", "BACKWARD_PROGRAMS_PER_SM",
                "TOKEN_FWD_QK_TOGETHER", "TOKEN_FWD_ELEMENTS_PER_WARP")
FORCED: dict[str, int] = {}
# The token-norm backward's tokens per program once there are enough programs anyway (a first
# guess, not swept), that is from LONG_RUN_MIN_TOKENS tokens (64 groups of 16).
LONG_RUN_TOKENS = 16
LONG_RUN_MIN_TOKENS = 1024
# Warps per program of the token-norm forward (a first guess) and of both backwards: 4 (in the
# per-head backward's sweep 8 was slower at every matched setting, results/README.md, 2026-11-27).
TOKEN_FWD_WARPS = 4
BACKWARD_WARPS = 4
# The per-head backward's token loop in 3 software-pipelining stages (Triton's pipeliner issues a
# later token's loads while a token is computed) where the head, padded to a power of two, is at
# most PIPELINED_MAX_HEAD_DIM wide; one stage (none) above. H100, bf16, 2048 elements, 16 tokens a
# program (tools/qknorm_launch_sweep.py, results/README.md, 2026-11-27): Qwen3-8B's heads at 1k
# tokens 33.1 -> 28.6 us, 4k 75.5 -> 75.1, 4 x 4k 213.1 -> 213.9, 32k 417.2 -> 410.4; Qwen3-0.6B's
# at 16k 151.6 -> 144.6; Gemma3's heads of 256 at 8k 107.3 -> 137.1, hence the limit.
BACKWARD_STAGES = 3
PIPELINED_MAX_HEAD_DIM = 128
# The weight gradients' reduction (weight_grads): programs of 8 columns (a head of 128 is 16 of
# them per tensor), each summing its rows 128 at a time on 4 warps. H100, Qwen3-8B's heads, the
# partial rows of 4k to 32k tokens (256-264 + 128-132 rows of 128): 1.6-1.7 us, against 2.4-2.6
# at 32 columns x 32 rows and 1.7-2.0 at 8 x 256, 16 x 64 to 16 x 256 or 4 x 256 (one run each,
# 2026-11-27).
WEIGHT_GRAD_BLOCK_COLUMNS = 8
WEIGHT_GRAD_BLOCK_ROWS = 128
WEIGHT_GRAD_WARPS = 4
# The reduction's launch follows the backward's by programmatic dependent launch where the GPU has
# it (sm_90 and up): the backward's programs let it launch once they have all started, and its
# programs wait for the backward's grid to end before they read the partial rows. Its launch and
# set-up then overlap the backward's last tokens instead of following them. H100, bf16, Qwen3-8B's
# heads, the per-head backward (tools/qknorm_launch_sweep.py, one run, 5ba3101): 64 decode tokens
# 4.0 us against 4.8, 4k, 4 x 4k and 32k tokens 48.8, 183.4 and 366.9 against 49.2, 185.0 and
# 368.1; OLMo2's norm at 64 decode tokens (plain loads) 4.8 against 5.5.
WEIGHT_GRAD_PDL = True
# OLMo2's TMA backward keeps the plain launch: there the dependent launch took 0.6-1.8 us longer
# at 4k, 4 x 4k and 32k tokens in each of three runs on the H100 (5ba3101: 58.2 against 57.1 us
# at 4k) and 1.4-1.8 us on the H200 (5c2438a).
TOKEN_BWD_TMA_PDL = False
# The per-head backward built as its minimal kernel (qknorm_kernels._backward_heads' MINIMAL): the
# norm and rotation replaced by a multiply-add per element, every load, store and partial row kept.
# For experiments only (tools/qknorm_minimal_probe.py): its results are not the gradients.
HEAD_BWD_MINIMAL = False


@dataclass(frozen=True)
class Geometry:
    """One validated call: sizes, how the angles come, and the launch's constexprs."""

    batch: int
    seqlen: int
    q_heads: int
    k_heads: int
    head_dim: int
    rotary_dim: int
    table: int            # K.TABLE_*
    table_rows: int
    interleaved: bool
    norm: str = "head"

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen


def _strides(x: Tensor, layout: str) -> tuple[int, int, int, int]:
    """x's (batch, sequence, head, channel) strides in ``layout`` (thd: batch stride 0)."""
    st = x.stride()
    if layout == "thd":
        return 0, st[0], st[1], st[2]
    b, s, h = BSH_AXES[layout]
    return st[b], st[s], st[h], st[3]


def _check_weight(w, name: str, head_dim: int, device, heads: int | None = None) -> None:
    """``[head_dim]`` (per-head norm), or ``[heads * head_dim]`` when ``heads`` is given."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in KERNEL_TORCH_DTYPES:
        raise TypeError(f"{name} has dtype {dtype_name(w.dtype)}; weights must be float32, float16 "
                        "or bfloat16")
    if heads is not None:
        if tuple(w.shape) != (heads * head_dim,):
            raise ValueError(f"{name} must be [heads * head_dim = {heads} * {head_dim}] (norm "
                             f"'token': one weight per channel of the token), got "
                             f"{tuple(w.shape)}")
    elif tuple(w.shape) != (head_dim,):
        raise ValueError(f"{name} must be [head_dim = {head_dim}] (one weight per channel, "
                         f"shared by every head), got {tuple(w.shape)}")
    if w.device != device:
        raise ValueError(f"{name} is on {w.device} but q is on {device}")


def validate(*, q, k, q_weight, k_weight, eps, cos, sin, positions, style, layout, rotary_dim,
             base, norm: str = "head") -> Geometry:
    """Every check that needs no tensor contents; raises before any launch."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; expected one of {NORMS}")
    check_input(q, "q", layout, "qk_norm_rope")
    check_input(k, "k", layout, "qk_norm_rope")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {dtype_name(k.dtype)} but q has {dtype_name(q.dtype)}")
    _triton.check_device(("q", q), ("k", k))
    batch, seqlen, hq, d = geometry(q, layout)
    kb, ks, hk, kd = geometry(k, layout)
    if (kb, ks, kd) != (batch, seqlen, d):
        raise ValueError(f"k {tuple(k.shape)} and q {tuple(q.shape)} must match in every "
                         f"dimension but heads (layout {layout})")
    if d > MAX_HEAD_DIM:
        raise NotImplementedError(f"head_dim {d} exceeds {MAX_HEAD_DIM} (a head row is held "
                                  "in registers)")
    token = norm == "token"
    _check_weight(q_weight, "q_weight", d, q.device, hq if token else None)
    _check_weight(k_weight, "k_weight", d, q.device, hk if token else None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 <= eps < math.inf):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    rot = d if rotary_dim is None else rotary_dim
    if isinstance(rot, bool) or not isinstance(rot, int) or rot <= 0 or rot % 2 or rot > d:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={d}], got {rotary_dim!r}")
    if layout == "thd" and positions is None:
        raise NotImplementedError("layout 'thd' needs per-token positions [t] (cu_seqlens is "
                                  "not taken by qk_norm_rope)")
    if positions is not None:
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
        if positions.dtype not in INDEX_DTYPES:
            raise TypeError(f"positions must be int32 or int64, got {dtype_name(positions.dtype)}")
        shapes = [(seqlen,)] if layout == "thd" else [(batch, seqlen), (seqlen,)]
        if tuple(positions.shape) not in shapes:
            raise ValueError(f"positions must have shape {' or '.join(map(str, shapes))}, got "
                             f"{tuple(positions.shape)}")
        if positions.device != q.device:
            raise ValueError(f"positions is on {positions.device} but q is on {q.device}")
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither (angles computed from base)")
    table, rows = K.TABLE_COMPUTED, 0
    if cos is not None:
        for name, t in (("cos", cos), ("sin", sin)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in KERNEL_TORCH_DTYPES:
                raise TypeError(f"{name} has dtype {dtype_name(t.dtype)}; cos/sin must be float32 "
                                "(recommended), float16 or bfloat16")
            if t.dim() != 2 or t.shape[1] not in (rot, rot // 2) or t.shape[0] == 0:
                raise ValueError(f"{name} must be [max_position, rotary_dim={rot}] (or "
                                 f"[max_position, {rot // 2}], one angle per pair), got "
                                 f"{tuple(t.shape)}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if cos.shape != sin.shape or cos.stride() != sin.stride():
            raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the "
                             "same shape and strides")
        table = K.TABLE_HALF if cos.shape[1] == rot // 2 else K.TABLE_FULL
        rows = cos.shape[0]
    elif isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise ValueError(f"base must be a positive number, got {base!r}")
    return Geometry(batch=batch, seqlen=seqlen, q_heads=hq, k_heads=hk, head_dim=d,
                    rotary_dim=rot, table=table, table_rows=rows,
                    interleaved=style == "interleaved", norm=norm)


def check_positions_in_table(g: Geometry, positions: Tensor | None) -> None:
    """Every position indexes a table row (ids cost one device sync; skipped during a CUDA-graph
    capture, which allows none: the kernel clamps rows, so a bad id is wrong, never a fault)."""
    if g.table == K.TABLE_COMPUTED:
        return
    if positions is None:
        if g.seqlen > g.table_rows:
            raise IndexError(f"positions reach {g.seqlen - 1} but cos/sin have {g.table_rows} "
                             "rows: every position must index a row")
        return
    if not positions.numel():
        return
    if positions.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lo, hi = (int(v) for v in torch.stack([positions.min(), positions.max()]).tolist())
    if lo < 0 or hi >= g.table_rows:
        raise IndexError(f"positions reach [{lo}, {hi}] but cos/sin have {g.table_rows} rows: "
                         "every position must index a row")


@functools.lru_cache(maxsize=64)
def _inv_freq(device: torch.device, rotary_dim: int, base: float) -> Tensor:
    """``base ** (-2j / R)`` in float64 (the oracle's own builder), cached per device."""
    return tables.inv_freq(rotary_dim, base, device=device)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def launch_constant(name: str, device: torch.device) -> int:
    """One of :data:`DEVICE_TUNED` on ``device``: FORCED's value, else the device family's
    table's, else the module's."""
    if name in FORCED:
        return FORCED[name]
    if device.type == "cuda":
        tuned = tuning.qknorm_constants(_cuda_index(device))
        if name in tuned:
            return tuned[name]
    return globals()[name]


def _block_heads(heads: int, head_dim: int, elements: int) -> int:
    """Heads per program: a power of two (``tl.arange``), at most ``elements`` channels in all
    (head_dim padded to a power of two), no more than the heads there are."""
    fit = max(1, elements // triton.next_power_of_2(head_dim))
    return max(1, min(triton.next_power_of_2(heads), 1 << (fit.bit_length() - 1)))


def _token_blocks(g: Geometry, block_elements: int, block_warps: int, whole_elements: int,
                  elements_per_warp: int, min_whole_warps: int, *, both_tensors: bool = False,
                  most_per_thread: int | None = None) -> tuple[int, int, bool, int]:
    """norm="token": (q heads a block, k heads a block, whole token, warps). Every head of a
    tensor in one block where q's and k's heads, padded to powers of two, hold at most
    ``whole_elements`` channels, on ``elements_per_warp`` a warp (at least ``min_whole_warps``;
    ``both_tensors``: a program holds q's block and k's, and its warps are the power of two at
    or below their elements over ``elements_per_warp``; ``most_per_thread``: more warps where a
    thread would hold more elements); else blocks of ``block_elements`` on ``block_warps``."""
    p2 = triton.next_power_of_2
    whole = max(p2(g.q_heads), p2(g.k_heads)) * p2(g.head_dim)
    if whole <= whole_elements:
        held = (p2(g.q_heads) + p2(g.k_heads)) * p2(g.head_dim) if both_tensors else whole
        warps = 1 << (max(1, held // elements_per_warp).bit_length() - 1)
        if most_per_thread:
            warps = max(warps, p2(triton.cdiv(held, 32 * most_per_thread)))
        return p2(g.q_heads), p2(g.k_heads), True, max(min_whole_warps, warps)
    return (_block_heads(g.q_heads, g.head_dim, block_elements),
            _block_heads(g.k_heads, g.head_dim, block_elements), False, block_warps)


def _token_descriptors(g: Geometry, layout: str, reads, writes, weights,
                       blocks) -> tuple | None:
    """TMA descriptors for the whole-token backward, or None where TMA cannot serve it: over each
    of ``reads`` (q, k, dq_out, dk_out) and ``writes`` (dq, dk) as ``[batch, seq, heads,
    head_dim]``, blocks of ``[1, 1, heads a block, head_dim / 2]`` (a token's rows, split into
    pair members) to read and ``[1, 1, heads a block, head_dim]`` to write; then over each of
    ``weights`` as ``[heads, head_dim]``, blocks of ``[heads a block, head_dim / 2]``;
    ``blocks``: q's and k's heads a block. None for interleaved pairs or an unrotated tail, a
    half that is not a power of two of at least 16 bytes, rows, strides or weights not 16-byte
    aligned, tokens not batch-major (sbhd, bhsd), a GPU older than Hopper; or where the kernel
    would spill registers: angles computed in the kernel (fp64 cos/sin; 64 bytes on sm_90 under
    Triton 3.6, fp16, 8 warps)."""
    half = g.head_dim // 2
    rows = reads + writes
    if g.tokens == 0 or min(t.shape[-2] for t in rows) == 0:
        return None
    if (g.interleaved or g.rotary_dim != g.head_dim or half & (half - 1)
            or half * min(t.element_size() for t in rows + weights) < 16
            or max(blocks + (g.head_dim,)) > 256  # a TMA block's dimensions: 256 at most
            # a pipelined read's block under 1 KB: its stages' buffers in shared memory fall off
            # TMA's alignment ("misaligned address" on the H100: fp32, 2 heads of 16)
            or min(blocks) * half * rows[0].element_size() < 1024
            or layout not in ("bshd", "thd") or g.table == K.TABLE_COMPUTED):
        return None
    x = rows[0]
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return None
    descs = []
    for i, t in enumerate(rows):
        sb, ss, sh, sd = _strides(t, layout)
        heads, item = t.shape[-2], t.element_size()
        sb = sb if g.batch > 1 else g.seqlen * ss  # thd, or one sequence: any aligned stride
        if (sd != 1 or t.data_ptr() % 16 or any(v * item % 16 or v <= 0 for v in (sb, ss, sh))
                or sh < g.head_dim or ss < heads * sh or sb < g.seqlen * ss):
            return None
        width = half if i < len(reads) else g.head_dim
        descs.append(TensorDescriptor(t, [g.batch, g.seqlen, heads, g.head_dim],
                                      [sb, ss, sh, 1], [1, 1, blocks[i % 2], width]))
    for w, block in zip(weights, blocks):
        if w.stride(0) != 1 or w.data_ptr() % 16 or g.head_dim * w.element_size() % 16:
            return None
        heads = w.shape[0] // g.head_dim
        descs.append(TensorDescriptor(w, [heads, g.head_dim], [g.head_dim, 1], [block, half]))
    return tuple(descs)


def _partial_descriptors(g: Geometry, parts, blocks) -> tuple:
    """TMA descriptors over the fp32 partial rows ``[groups, heads * head_dim]`` (contiguous, new)
    as ``[groups, heads, head_dim]``, blocks of ``[1, heads a block, head_dim / 2]``."""
    return tuple(TensorDescriptor(p, [p.shape[0], p.shape[1] // g.head_dim, g.head_dim],
                                  [p.shape[1], g.head_dim, 1], [1, block, g.head_dim // 2])
                 for p, block in zip(parts, blocks))


def _common(g: Geometry, q: Tensor, cos, sin, positions, base) -> tuple[list, dict]:
    """The launch arguments both kernels share: (pointer args, scalar/constexpr kwargs)."""
    half = g.rotary_dim // 2
    tail = g.head_dim - g.rotary_dim
    dummy = q  # an unused pointer argument (never dereferenced)
    if g.table == K.TABLE_COMPUTED:
        inv, cos_t, sin_t, tsr, tsc = _inv_freq(q.device, g.rotary_dim, float(base)), dummy, \
            dummy, 0, 0
    else:
        inv, cos_t, sin_t, tsr, tsc = dummy, cos, sin, cos.stride(0), cos.stride(1)
    if positions is None:
        pos, psb, pss = dummy, 0, 0
    elif positions.dim() == 1:
        pos, psb, pss = positions, 0, positions.stride(0)
    else:
        pos, psb, pss = positions, positions.stride(0), positions.stride(1)
    ptrs = [cos_t, sin_t, inv, pos]
    scalars = dict(tsr=tsr, tsc=tsc, psb=psb, pss=pss, D=g.head_dim, HALF=half,
                   PAIR_BLOCK=triton.next_power_of_2(half),
                   TAIL_BLOCK=triton.next_power_of_2(tail) if tail else 1,
                   INTERLEAVED=g.interleaved, TABLE=g.table, HAS_POS=positions is not None,
                   HAS_TAIL=tail > 0)
    return ptrs, scalars


def forward(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, *, cos, sin,
            positions, style, layout, rotary_dim, base, gemma, check_positions,
            in_place: bool, norm: str = "head") -> tuple[Tensor, Tensor]:
    """Validate, then one launch: new contiguous outputs, or q and k overwritten."""
    g = validate(q=q, k=k, q_weight=q_weight, k_weight=k_weight, eps=eps, cos=cos, sin=sin,
                 positions=positions, style=style, layout=layout, rotary_dim=rotary_dim,
                 base=base, norm=norm)
    if in_place and q.numel() and q.data_ptr() == k.data_ptr():
        raise ValueError("q and k are the same memory; in place they must be distinct tensors")
    if check_positions:
        check_positions_in_table(g, positions)
    if in_place:
        qo, ko = q, k
    else:
        qo, ko = _alloc.empty(q.shape, dtype=q.dtype, device=q.device), \
            _alloc.empty(k.shape, dtype=k.dtype, device=k.device)
    if g.tokens == 0 or g.q_heads + g.k_heads == 0:
        return qo, ko
    ptrs, kw = _common(g, q, cos, sin, positions, base)
    if g.norm == "token":
        strides = [_strides(t, layout) for t in (q, k, qo, ko)]
        # Strided channels load element by element, an address register each: half the
        # elements a warp then (32 + 8 heads of 96 on 2 warps spilled registers on sm_90).
        contiguous = all(st[3] == 1 for st in strides) and kw["tsc"] in (0, 1) \
            and q_weight.stride(0) == 1 and k_weight.stride(0) == 1
        together, per_warp = token_forward_launch(g.tokens, q.device)
        shrink = 1 if contiguous else 2
        bq, bk, whole_token, warps = _token_blocks(
            g, TOKEN_FWD_BLOCK_ELEMENTS, TOKEN_FWD_WARPS,
            0 if g.table == K.TABLE_COMPUTED else TOKEN_FWD_WHOLE_ELEMENTS,
            per_warp // shrink, 1,
            both_tensors=together,
            most_per_thread=token_forward_most_a_thread(
                q.element_size(), max(q_weight.element_size(), k_weight.element_size()),
                contiguous=contiguous,
                interleaved_tail=g.interleaved and g.rotary_dim < g.head_dim))
        with _triton.device_guard(q.device):
            K.qk_token_norm_rope_fwd_kernel[(g.tokens, 1 if whole_token and together else 2)](
                q, k, qo, ko, q_weight, k_weight, *ptrs,
                g.seqlen, g.q_heads, g.k_heads, max(g.table_rows, 1), float(eps),
                *(x for st in strides for x in st), q_weight.stride(0), k_weight.stride(0),
                BLOCK_HQ=bq, BLOCK_HK=bk, GEMMA=gemma, WHOLE_TOKEN=whole_token,
                QK_TOGETHER=together, num_warps=warps, **kw)
        return qo, ko
    elements = launch_constant("HEAD_FWD_BLOCK_ELEMENTS", q.device)
    bq = _block_heads(g.q_heads, g.head_dim, elements)
    bk = _block_heads(g.k_heads, g.head_dim, elements)
    qb, kb = triton.cdiv(g.q_heads, bq), triton.cdiv(g.k_heads, bk)
    if g.tokens * (qb + kb) > _triton.MAX_GRID_X:
        raise ValueError(f"{g.tokens} tokens x {qb + kb} head blocks exceed the grid's x limit "
                         f"({_triton.MAX_GRID_X} programs); split the call over the tokens")
    with _triton.device_guard(q.device):
        K.qk_norm_rope_fwd_kernel[(g.tokens * (qb + kb),)](
            q, k, qo, ko, q_weight, k_weight, *ptrs,
            g.seqlen, g.q_heads, g.k_heads, qb, qb + kb, max(g.table_rows, 1), float(eps),
            *_strides(q, layout), *_strides(k, layout), *_strides(qo, layout),
            *_strides(ko, layout), q_weight.stride(0), k_weight.stride(0),
            BLOCK_HQ=bq, BLOCK_HK=bk, GEMMA=gemma,
            num_warps=launch_constant("HEAD_FWD_WARPS", q.device), **kw)
    return qo, ko


def token_forward_launch(tokens: int, device: torch.device) -> tuple[bool, int]:
    """The token-norm forward's (q and k together, elements a warp): the GPU's
    (:func:`launch_constant`), but with fewer tokens than SMs (decode) q and k together and at
    most TOKEN_FWD_FEW_TOKENS_ELEMENTS_PER_WARP a warp, unless FORCED names the constant."""
    together = bool(launch_constant("TOKEN_FWD_QK_TOGETHER", device))
    per_warp = launch_constant("TOKEN_FWD_ELEMENTS_PER_WARP", device)
    if tokens < _sms(device):
        together = together or "TOKEN_FWD_QK_TOGETHER" not in FORCED
        if "TOKEN_FWD_ELEMENTS_PER_WARP" not in FORCED:
            per_warp = min(per_warp, TOKEN_FWD_FEW_TOKENS_ELEMENTS_PER_WARP)
    return together, per_warp


def token_forward_most_a_thread(item: int, weight_item: int, *, contiguous: bool,
                                interleaved_tail: bool) -> int:
    """The most of a token a thread of the one-pass token-norm forward holds, by the rows' and
    the weights' element sizes (TOKEN_FWD_MOST_ELEMENTS_A_THREAD), fewer where the channels are
    strided or the pairs interleaved beside an unrotated tail: the most that compile without a
    register spill on sm_90."""
    if not contiguous:
        return TOKEN_FWD_MOST_STRIDED_ELEMENTS_A_THREAD
    most = TOKEN_FWD_MOST_ELEMENTS_A_THREAD[item, weight_item]
    return min(most, TOKEN_FWD_MOST_INTERLEAVED_TAIL_ELEMENTS_A_THREAD) if interleaved_tail \
        else most


def _sms(device: torch.device) -> int:
    """The device's SMs; a CPU tensor (the Triton interpreter) counts as one."""
    return sm_count(_cuda_index(device)) if device.type == "cuda" else 1


def backward_tokens_per_program(tokens: int, head_blocks: int, device: torch.device) -> int:
    """The per-head backward's tokens a program: the fewest that keep the grid
    (token groups x head blocks) within about ``BACKWARD_PROGRAMS_PER_SM`` programs per SM, and
    at least one."""
    budget = launch_constant("BACKWARD_PROGRAMS_PER_SM", device) * _sms(device)
    return max(1, triton.cdiv(tokens * head_blocks, budget))


def head_backward_grid(g: Geometry, q: Tensor) -> tuple[int, int, int, int, int, int]:
    """The per-head backward's launch for call ``g`` (:func:`validate`'s) of q's element size and
    device: (q heads a block, k heads a block, q head blocks, k head blocks, tokens a program,
    token groups). Its weight-gradient partial rows: groups x q head blocks, and for k."""
    elements = HEAD_BWD_BLOCK_ELEMENTS[q.element_size(), g.rotary_dim < g.head_dim]
    bq = _block_heads(g.q_heads, g.head_dim, elements)
    bk = _block_heads(g.k_heads, g.head_dim, elements)
    qb, kb = triton.cdiv(g.q_heads, bq), triton.cdiv(g.k_heads, bk)
    tpp = backward_tokens_per_program(g.tokens, qb + kb, q.device)
    return bq, bk, qb, kb, tpp, triton.cdiv(g.tokens, tpp)


def _pdl(device: torch.device) -> bool:
    """Whether the weight-gradient reduction follows the backward by programmatic dependent
    launch on ``device`` (``WEIGHT_GRAD_PDL``, a CUDA device of compute capability 9.0 or up)."""
    return bool(WEIGHT_GRAD_PDL) and device.type == "cuda" \
        and torch.cuda.get_device_capability(device)[0] >= 9


def _dense(g: Tensor | None, like: Tensor) -> Tensor:
    """A gradient autograd left undefined is zeros (any strides are taken, zero ones included)."""
    return torch.zeros_like(like) if g is None else g


def backward(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Tensor,
             k_weight: Tensor, eps: float, *, cos, sin, positions, style, layout, rotary_dim,
             base, gemma, norm: str = "head") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dq_weight, dk_weight): one launch, then a fixed-order sum of the partial rows."""
    g = validate(q=q, k=k, q_weight=q_weight, k_weight=k_weight, eps=eps, cos=cos, sin=sin,
                 positions=positions, style=style, layout=layout, rotary_dim=rotary_dim,
                 base=base, norm=norm)
    dq_out, dk_out = _dense(dq_out, q), _dense(dk_out, k)
    for name, grad, x in (("dq_out", dq_out, q), ("dk_out", dk_out, k)):
        if grad.shape != x.shape or grad.dtype != x.dtype or grad.device != x.device:
            raise ValueError(f"{name} {tuple(grad.shape)} {dtype_name(grad.dtype)} must match its "
                             f"input {tuple(x.shape)} {dtype_name(x.dtype)}")
    dq = _alloc.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = _alloc.empty(k.shape, dtype=k.dtype, device=k.device)
    if g.norm == "token":
        # Several tokens per program once the grid has plenty of programs without them: fewer
        # partial rows (the deterministic reduction's cost), same parallelism.
        tpp = LONG_RUN_TOKENS if g.tokens >= LONG_RUN_MIN_TOKENS else 1
        bq, bk, whole_token, warps = _token_blocks(
            g, TOKEN_BWD_BLOCK_ELEMENTS, BACKWARD_WARPS, TOKEN_BWD_WHOLE_ELEMENTS,
            TOKEN_BWD_ELEMENTS_PER_WARP, BACKWARD_WARPS)
        descs, stages = None, TOKEN_BWD_STAGES
        together = bool(TOKEN_BWD_TMA_QK_TOGETHER[q.element_size()])
        groups = (TOKEN_BWD_TMA_PROGRAMS_PER_SM if together
                  else max(1, TOKEN_BWD_TMA_PROGRAMS_PER_SM // 2)) * _sms(q.device)
        # TMA's gain is a program's later tokens staged while one is computed: none where each
        # program would take one token (decode's 64 tokens: 7.0 us through TMA, 5.7 with plain
        # loads, H100 suites b688c59 and 0f972c8)
        if whole_token and TOKEN_BWD_TMA and g.tokens > groups:
            descs = _token_descriptors(g, layout, (q, k, dq_out, dk_out), (dq, dk),
                                       (q_weight, k_weight), (bq, bk))
        together = together and descs is not None
        if descs is not None:
            spread = triton.cdiv(g.tokens, groups)
            tpp = min(TOKEN_BWD_TMA_TOKENS,
                      spread if together else triton.next_power_of_2(spread))
            stages = TOKEN_BWD_TMA_STAGES
            per_warp = TOKEN_BWD_TMA_ELEMENTS_PER_WARP[q.element_size()]
            warps = max(BACKWARD_WARPS, bq * triton.next_power_of_2(g.head_dim) // per_warp)
        return _backward_token_norm(g, dq_out, dk_out, dq, dk, q, k, q_weight, k_weight, eps,
                                    cos, sin, positions, base, gemma, layout, bq, bk, tpp,
                                    triton.cdiv(g.tokens, tpp), whole_token, warps, descs,
                                    stages, together)
    bq, bk, qb, kb, tpp, groups = head_backward_grid(g, q)
    qpart = _alloc.empty((groups * qb, g.head_dim), dtype=torch.float32, device=q.device)
    kpart = _alloc.empty((groups * kb, g.head_dim), dtype=torch.float32, device=q.device)
    pdl = _pdl(q.device)
    if g.tokens and qb + kb:
        if qb + kb > _triton.MAX_GRID_Y:
            raise ValueError(f"{qb + kb} head blocks exceed the grid's y limit")
        ptrs, kw = _common(g, q, cos, sin, positions, base)
        with _triton.device_guard(q.device):
            K.qk_norm_rope_bwd_kernel[(groups, qb + kb)](
                q, k, dq_out, dk_out, dq, dk, q_weight, k_weight, qpart, kpart, *ptrs,
                g.tokens, g.seqlen, g.q_heads, g.k_heads, qb, kb, max(g.table_rows, 1),
                float(eps), tpp, *_strides(q, layout), *_strides(k, layout),
                *_strides(dq_out, layout), *_strides(dk_out, layout), *_strides(dq, layout),
                *_strides(dk, layout), q_weight.stride(0), k_weight.stride(0),
                BLOCK_HQ=bq, BLOCK_HK=bk, GEMMA=gemma,
                STAGES=(BACKWARD_STAGES if triton.next_power_of_2(g.head_dim)
                        <= PIPELINED_MAX_HEAD_DIM else 1),
                PDL=pdl, MINIMAL=bool(HEAD_BWD_MINIMAL), num_warps=BACKWARD_WARPS, **kw)
    return (dq, dk) + weight_grads(qpart, kpart, q_weight, k_weight, pdl)


def weight_grads(qpart: Tensor, kpart: Tensor, q_weight: Tensor, k_weight: Tensor,
                 pdl: bool = False) -> tuple[Tensor, Tensor]:
    """(dq_weight, dk_weight): the fp32 partial rows' column sums in a fixed order, in the
    weights' dtypes, in one launch; ``pdl``: launched as the programmatic dependent of the
    backward launched with ``PDL`` just before it."""
    dqw = _alloc.empty(q_weight.shape, dtype=q_weight.dtype, device=q_weight.device)
    dkw = _alloc.empty(k_weight.shape, dtype=k_weight.dtype, device=k_weight.device)
    cols = max(qpart.shape[1], kpart.shape[1])
    with _triton.device_guard(qpart.device):
        K.weight_grad_kernel[(triton.cdiv(cols, WEIGHT_GRAD_BLOCK_COLUMNS), 2)](
            qpart, kpart, dqw, dkw, qpart.shape[0], kpart.shape[0], qpart.shape[1],
            kpart.shape[1], BLOCK_R=WEIGHT_GRAD_BLOCK_ROWS, BLOCK_C=WEIGHT_GRAD_BLOCK_COLUMNS,
            PDL=pdl, launch_pdl=pdl, num_warps=WEIGHT_GRAD_WARPS)
    return dqw, dkw


def _backward_token_norm(g: Geometry, dq_out, dk_out, dq, dk, q, k, q_weight, k_weight, eps,
                         cos, sin, positions, base, gemma, layout, bq, bk, tpp, groups,
                         whole_token, warps, descs, stages, together):
    """norm="token": one launch over (token groups, q and k), then the fixed-order sums of the
    ``[groups, heads * head_dim]`` partial rows. ``whole_token``: every head of q in one block
    of ``bq`` and of k in one of ``bk`` (one pass a token); ``descs``: the TMA descriptors of
    :func:`_token_descriptors`, or None (plain loads and stores); ``together`` (through TMA
    only): a token's q and k in one program."""
    qpart = _alloc.empty((groups, g.q_heads * g.head_dim), dtype=torch.float32, device=q.device)
    kpart = _alloc.empty((groups, g.k_heads * g.head_dim), dtype=torch.float32, device=q.device)
    pdl = _pdl(q.device) and (descs is None or TOKEN_BWD_TMA_PDL)
    if descs is not None:
        descs += _partial_descriptors(g, (qpart, kpart), (bq, bk))
    if g.tokens and g.q_heads + g.k_heads:
        ptrs, kw = _common(g, q, cos, sin, positions, base)
        with _triton.device_guard(q.device):
            K.qk_token_norm_rope_bwd_kernel[(groups, 1 if together else 2)](
                q, k, dq_out, dk_out, *(descs or (None,) * 10), dq, dk, q_weight, k_weight, qpart,
                kpart, *ptrs,
                g.tokens, g.seqlen, g.q_heads, g.k_heads, max(g.table_rows, 1), float(eps),
                tpp, *_strides(q, layout), *_strides(k, layout),
                *_strides(dq_out, layout), *_strides(dk_out, layout), *_strides(dq, layout),
                *_strides(dk, layout), q_weight.stride(0), k_weight.stride(0),
                BLOCK_HQ=bq, BLOCK_HK=bk, GEMMA=gemma,
                # through TMA the count is a runtime argument: one build for any count
                TOKENS_PER_PROGRAM=1 if descs is not None else tpp,
                WHOLE_TOKEN=whole_token, TMA=descs is not None, QK_TOGETHER=together,
                STAGES=stages, PDL=pdl, num_warps=warps, **kw)
    return (dq, dk) + weight_grads(qpart, kpart, q_weight, k_weight, pdl)


# ---- custom ops ----------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::qk_norm_rope", mutates_args=())
def qk_norm_rope_op(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                    cos: Tensor | None, sin: Tensor | None, positions: Tensor | None, style: str,
                    layout: str, rotary_dim: int | None, base: float, gemma: bool,
                    check_positions: bool, norm: str = "head") -> tuple[Tensor, Tensor]:
    """New contiguous (q_out, k_out)."""
    return forward(q, k, q_weight, k_weight, eps, cos=cos, sin=sin, positions=positions,
                   style=style, layout=layout, rotary_dim=rotary_dim, base=base, gemma=gemma,
                   check_positions=check_positions, in_place=False, norm=norm)


def _contiguous_like(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@qk_norm_rope_op.register_fake
def _qk_norm_rope_fake(q, k, q_weight, k_weight, eps, cos, sin, positions, style, layout,
                       rotary_dim, base, gemma, check_positions, norm="head"):
    return _contiguous_like(q), _contiguous_like(k)


@torch.library.custom_op(f"{NAMESPACE}::qk_norm_rope_backward", mutates_args=())
def qk_norm_rope_backward_op(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor,
                             q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor | None,
                             sin: Tensor | None, positions: Tensor | None, style: str,
                             layout: str, rotary_dim: int | None, base: float, gemma: bool,
                             norm: str = "head") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dq_weight, dk_weight); dq and dk contiguous."""
    return backward(dq_out, dk_out, q, k, q_weight, k_weight, eps, cos=cos, sin=sin,
                    positions=positions, style=style, layout=layout, rotary_dim=rotary_dim,
                    base=base, gemma=gemma, norm=norm)


@qk_norm_rope_backward_op.register_fake
def _qk_norm_rope_backward_fake(dq_out, dk_out, q, k, q_weight, k_weight, eps, cos, sin,
                                positions, style, layout, rotary_dim, base, gemma, norm="head"):
    return (_contiguous_like(q), _contiguous_like(k), _contiguous_like(q_weight),
            _contiguous_like(k_weight))


def _setup_context(ctx, inputs, output):
    (q, k, q_weight, k_weight, eps, cos, sin, positions, style, layout, rotary_dim, base,
     gemma) = inputs[:13]
    norm = inputs[14] if len(inputs) > 14 else "head"  # the schema's default when not passed
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin, positions)
    ctx.scalars = (eps, style, layout, rotary_dim, base, gemma, norm)


def _backward(ctx, dq_out, dk_out):
    q, k, q_weight, k_weight, cos, sin, positions = ctx.saved_tensors
    eps, style, layout, rotary_dim, base, gemma, norm = ctx.scalars
    dq, dk, dqw, dkw = qk_norm_rope_backward_op(
        _dense(dq_out, q), _dense(dk_out, k), q, k, q_weight, k_weight, eps, cos, sin,
        positions, style, layout, rotary_dim, base, gemma, norm)
    return (dq, dk, dqw, dkw) + (None,) * 11


qk_norm_rope_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(f"{NAMESPACE}::qk_norm_rope_", mutates_args=("q", "k"))
def qk_norm_rope_inplace_op(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor,
                            eps: float, cos: Tensor | None, sin: Tensor | None,
                            positions: Tensor | None, style: str, layout: str,
                            rotary_dim: int | None, base: float, gemma: bool,
                            check_positions: bool, norm: str = "head") -> None:
    """q and k overwritten by their outputs."""
    forward(q, k, q_weight, k_weight, eps, cos=cos, sin=sin, positions=positions, style=style,
            layout=layout, rotary_dim=rotary_dim, base=base, gemma=gemma,
            check_positions=check_positions, in_place=True, norm=norm)


@qk_norm_rope_inplace_op.register_fake
def _qk_norm_rope_inplace_fake(q, k, q_weight, k_weight, eps, cos, sin, positions, style, layout,
                               rotary_dim, base, gemma, check_positions, norm="head"):
    return None


# ---- public functions ----------------------------------------------------------------------------
def _op_args(q, k, q_weight, k_weight, eps, cos, sin, positions, style, layout, rotary_dim,
             base, gemma, check_positions, norm="head") -> tuple:
    """The ops' arguments, with the Python types their schema needs checked here (a wrong type
    would otherwise surface as a schema error)."""
    for name, v in (("eps", eps), ("base", base)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    for name, v in (("gemma", gemma), ("check_positions", check_positions)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    if not isinstance(style, str) or not isinstance(layout, str) or not isinstance(norm, str):
        raise TypeError("style, layout and norm must be strings")
    return (q, k, q_weight, k_weight, float(eps), cos, sin, positions, style, layout,
            rotary_dim, float(base), gemma, check_positions, norm)


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, *,
                 cos: Tensor | None = None, sin: Tensor | None = None,
                 positions: Tensor | None = None, style: str = "rotate_half",
                 layout: str = "bshd", rotary_dim: int | None = None, base: float = 10000.0,
                 gemma: bool = False, check_positions: bool = True,
                 norm: str = "head") -> tuple[Tensor, Tensor]:
    """RMSNorm each head of q and k (weights of head_dim elements), then rotate them by RoPE.

    Parameters
    ----------
    q, k
        ``[b, s, h, d]`` (bshd), ``[s, b, h, d]`` (sbhd), ``[b, h, s, d]`` (bhsd) or packed
        ``[t, h, d]`` (thd, with ``positions``); float32/float16/bfloat16, the same for both;
        any strides. k may have fewer heads (GQA/MQA).
    q_weight, k_weight
        ``[d]``, float32/float16/bfloat16: the RMSNorm weights (``q_norm.weight``,
        ``k_norm.weight``); ``[hq * d]`` and ``[hk * d]`` with ``norm="token"``.
    eps
        The RMSNorm epsilon (``rms_norm_eps``), >= 0.
    cos, sin
        ``[L, rotary_dim]`` in the style's natural layout, or ``[L, rotary_dim / 2]``; row =
        position. Omit both to compute the angles in fp64 in the kernel from ``base``.
    positions
        int32/int64 ids ``[b, s]`` or ``[s]`` (thd: ``[t]``); None: token i at position i.
    style
        ``rotate_half`` (NeoX/HF) or ``interleaved`` (GPT-J).
    rotary_dim
        Rotated channels R (even, <= d); the rest are normalised only.
    gemma
        Gemma's RMSNorm: ``x_hat * (1 + w)``.
    check_positions
        Check that every position indexes a table row (ids cost one device sync; skipped
        during a CUDA-graph capture).
    norm
        ``head`` (Qwen3, Gemma3): each head on its own; ``token`` (OLMo2): each token's heads
        of q (and of k) together, one weight per channel of the token.

    Returns
    -------
    (q_out, k_out): new contiguous tensors, q's and k's shape and dtype. Differentiable in q,
    k and both weights; the weight gradients are deterministic.

    Example
    -------
    >>> q_out, k_out = qk_norm_rope(q, k, attn.q_norm.weight, attn.k_norm.weight, 1e-6,
    ...                             cos=cos, sin=sin, layout="bshd")  # doctest: +SKIP
    """
    args = _op_args(q, k, q_weight, k_weight, eps, cos, sin, positions, style, layout,
                    rotary_dim, base, gemma, check_positions, norm)
    qo, ko = torch.ops.fastrope.qk_norm_rope(*args)
    return qo, ko


def qk_norm_rope_inplace(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                         *, cos: Tensor | None = None, sin: Tensor | None = None,
                         positions: Tensor | None = None, style: str = "rotate_half",
                         layout: str = "bshd", rotary_dim: int | None = None,
                         base: float = 10000.0, gemma: bool = False,
                         check_positions: bool = True, norm: str = "head"
                         ) -> tuple[Tensor, Tensor]:
    """As :func:`qk_norm_rope`, overwriting q and k; returns them. Inference only: refused while
    a gradient is recorded (the backward needs the inputs this overwrites)."""
    args = _op_args(q, k, q_weight, k_weight, eps, cos, sin, positions, style, layout,
                    rotary_dim, base, gemma, check_positions, norm)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k, q_weight, k_weight)):
        raise NotImplementedError("qk_norm_rope_inplace overwrites the inputs its backward "
                                  "needs: use qk_norm_rope when a gradient is recorded")
    torch.ops.fastrope.qk_norm_rope_(*args)
    return q, k


__all__ = ["qk_norm_rope", "qk_norm_rope_inplace", "validate", "forward", "backward"]
