"""Triton kernels of fused per-head RMSNorm then RoPE (:mod:`ports.fastrope.qknorm`).

Forward, one program per (token, block of heads), q's head blocks then k's on the grid's second
axis (one launch for both):

1. the token's position (given ids, or its index in the sequence) and its cos/sin: a table row
   (``[L, R]``: each pair member's own value; ``[L, R/2]``: one value per pair, clamped to the
   table) or, with no tables, ``pos * inv_freq`` and cos/sin in fp64, rounded to fp32;
2. each head row loaded once, as three pieces held in registers: the pairs' first members
   (rotate-half: channels ``j``; interleaved: ``2j``), their partners (``j + R/2``; ``2j + 1``)
   and the tail ``R..D-1`` that RoPE leaves alone;
3. ``sum(x^2)`` in fp32 over the D channels, ``rstd = rsqrt(sum / D + eps)``;
4. ``z = x * rstd * w`` (Gemma: ``1 + w``), fp32;
5. ``y1 = z1 c1 - z2 s1``, ``y2 = z2 c2 + z1 s2`` (the float64 oracle's ``x c + rot(x) s``), tail
   ``y = z``; one rounding to the output dtype at the store.

Backward, one program per (a group of tokens, block of heads), recomputing rstd from
the saved input (it has to read x anyway for x_hat, so saving rstd in the forward would only add
a write). With ``x_hat = x * rstd`` and ``W = w`` (or ``1 + w``):

* ``dz = R(-theta) dy``, the rotation's transpose: ``dz1 = dy1 c1 + dy2 s2``,
  ``dz2 = dy2 c2 - dy1 s1`` (exact for tables whose two members differ); tail ``dz = dy``;
* ``dweight += dz * x_hat``, summed per lane over the program's tokens, then over its heads, in
  registers, and written as one fp32 row of a ``[programs, D]`` buffer, whose columns
  ``weight_grad_kernel`` sums in a fixed order: the weight gradients are deterministic, run to
  run;
* ``dx_hat = dz * W``; ``dx = rstd * (dx_hat - x_hat * mean(dx_hat * x_hat))``.

Index width: token ids and head ids are int64 before any pointer arithmetic. Lanes past the
head count or the pair count are masked; their ``x_hat`` is forced to 0 so that a zero row with
``eps = 0`` cannot spill NaN into the weight-gradient sums.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

# How the kernels get each token's cos/sin (the TABLE constexpr).
TABLE_COMPUTED = 0  # pos * inv_freq and cos/sin in fp64
TABLE_FULL = 1      # [L, R]: each member's own value
TABLE_HALF = 2      # [L, R/2]: one value per pair


@triton.jit
def _let_dependents_launch(PDL: tl.constexpr):
    """With PDL (programmatic dependent launch, sm_90 and up): the launch that follows on the
    stream (``weight_grad_kernel``, which waits for this grid's writes before it reads them) may
    start once every program of this grid has started, not when the last one ends."""
    if PDL:
        tl_cuda.gdc_launch_dependents()


@triton.jit
def _members(HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Channel offsets [1, PAIR_BLOCK] of each pair's first and second member, and the pair ids."""
    j = tl.arange(0, PAIR_BLOCK)[None, :]
    if INTERLEAVED:
        o1 = 2 * j
        o2 = 2 * j + 1
    else:
        o1 = j
        o2 = j + HALF
    return j, o1, o2


@triton.jit
def _angles(b, s, valid, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr, tsc,
            HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
            TABLE: tl.constexpr, HAS_POS: tl.constexpr):
    """(c1, s1, c2, s2): the token's cos/sin for the pairs' first and second members, fp32
    [1, PAIR_BLOCK]."""
    j, o1, o2 = _members(HALF, PAIR_BLOCK, INTERLEAVED)
    pm = (j < HALF) & valid
    if HAS_POS:
        pos = tl.load(pos_ptr + b * psb + s * pss, mask=valid, other=0).to(tl.int64)
    else:
        pos = s
    if TABLE == 0:
        inv = tl.load(inv_ptr + j, mask=pm, other=0.0).to(tl.float64)
        ang = pos.to(tl.float64) * inv
        c1 = tl.cos(ang).to(tl.float32)
        s1 = tl.sin(ang).to(tl.float32)
        c2 = c1
        s2 = s1
    else:
        row = tl.minimum(tl.maximum(pos, 0), rows - 1) * tsr  # a bad id is wrong, not a fault
        if TABLE == 2:
            c1 = tl.load(cos_ptr + row + j * tsc, mask=pm, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + row + j * tsc, mask=pm, other=0.0).to(tl.float32)
            c2 = c1
            s2 = s1
        else:
            c1 = tl.load(cos_ptr + row + o1 * tsc, mask=pm, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + row + o1 * tsc, mask=pm, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + row + o2 * tsc, mask=pm, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + row + o2 * tsc, mask=pm, other=0.0).to(tl.float32)
    return c1, s1, c2, s2


@triton.jit
def _token_at(tok, T, S, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr, tsc,
              HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
              TABLE: tl.constexpr, HAS_POS: tl.constexpr):
    """Token ``tok`` of the whole-token backward loops: (valid, b, s, c1, s1, c2, s2)."""
    valid = tok < T
    b = tok // S
    s = tok - b * S
    c1, s1, c2, s2 = _angles(b, s, valid, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows,
                             tsr, tsc, HALF, PAIR_BLOCK, INTERLEAVED, TABLE, HAS_POS)
    return valid, b, s, c1, s1, c2, s2


@triton.jit
def _weights(w_ptr, sw, D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr,
             TAIL_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr, GEMMA: tl.constexpr):
    """The weight's three pieces (first members, partners, tail), fp32, ``1 + w`` for Gemma."""
    j, o1, o2 = _members(HALF, PAIR_BLOCK, INTERLEAVED)
    pm = j < HALF
    t = 2 * HALF + tl.arange(0, TAIL_BLOCK)[None, :]
    w1 = tl.load(w_ptr + o1 * sw, mask=pm, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + o2 * sw, mask=pm, other=0.0).to(tl.float32)
    wt = tl.load(w_ptr + t * sw, mask=t < D, other=0.0).to(tl.float32)
    if GEMMA:
        w1 = w1 + 1.0
        w2 = w2 + 1.0
        wt = wt + 1.0
    return w1, w2, wt


@triton.jit
def _load_rows(row_ptr, sd, hm, D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr,
               TAIL_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_TAIL: tl.constexpr):
    """A block of head rows [BLOCK_H, *] as fp32 (first members, partners, tail); masked lanes 0."""
    j, o1, o2 = _members(HALF, PAIR_BLOCK, INTERLEAVED)
    pm = hm & (j < HALF)
    x1 = tl.load(row_ptr + o1 * sd, mask=pm, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptr + o2 * sd, mask=pm, other=0.0).to(tl.float32)
    if HAS_TAIL:
        t = 2 * HALF + tl.arange(0, TAIL_BLOCK)[None, :]
        xt = tl.load(row_ptr + t * sd, mask=hm & (t < D), other=0.0).to(tl.float32)
    else:
        xt = tl.zeros([1, TAIL_BLOCK], dtype=tl.float32)
    return x1, x2, xt


@triton.jit
def _load_rows_tma(desc, b, s, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                   TAIL_BLOCK: tl.constexpr):
    """A token's rows [BLOCK_H, HALF] as fp32 (first members, partners; rotate-half, no tail)
    through a TMA descriptor over ``[batch, seq, heads, D]`` with block ``[1, 1, BLOCK_H, HALF]``:
    heads and tokens past the tensor read as 0. In a pipelined loop the loads land in shared
    memory, several tokens ahead, without holding registers."""
    bi = b.to(tl.int32)
    si = s.to(tl.int32)
    x1 = desc.load([bi, si, 0, 0]).reshape(BLOCK_H, HALF).to(tl.float32)
    x2 = desc.load([bi, si, 0, HALF]).reshape(BLOCK_H, HALF).to(tl.float32)
    return x1, x2, tl.zeros([1, TAIL_BLOCK], dtype=tl.float32)


@triton.jit
def _store_rows_tma(desc, b, s, y1, y2, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """:func:`_load_rows_tma`'s inverse: a token's rows from the pair members [BLOCK_H, HALF],
    rounded to the tensor's dtype, through a descriptor with block ``[1, 1, BLOCK_H, 2 * HALF]``;
    heads and tokens past the tensor are not written. One store a token: the next store waits
    for this one to leave shared memory, a token's work later (two stores, one a half, waited
    for each other: 8-9% slower, H100)."""
    bi = b.to(tl.int32)
    si = s.to(tl.int32)
    ty = desc.dtype
    y = tl.permute(tl.join(y1.to(ty), y2.to(ty)), (0, 2, 1)).reshape(1, 1, BLOCK_H, 2 * HALF)
    desc.store([bi, si, 0, 0], y)


@triton.jit
def _store_rows(row_ptr, sd, hm, y1, y2, yt, D: tl.constexpr, HALF: tl.constexpr,
                PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
                HAS_TAIL: tl.constexpr):
    j, o1, o2 = _members(HALF, PAIR_BLOCK, INTERLEAVED)
    pm = hm & (j < HALF)
    ty = row_ptr.dtype.element_ty
    tl.store(row_ptr + o1 * sd, y1.to(ty), mask=pm)
    tl.store(row_ptr + o2 * sd, y2.to(ty), mask=pm)
    if HAS_TAIL:
        t = 2 * HALF + tl.arange(0, TAIL_BLOCK)[None, :]
        tl.store(row_ptr + t * sd, yt.to(ty), mask=hm & (t < D))


@triton.jit
def _rstd(x1, x2, xt, eps, D: tl.constexpr):
    """[BLOCK_H, 1]: ``rsqrt(mean(x^2) + eps)`` per head row, fp32."""
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xt * xt, axis=1)
    return tl.rsqrt(ss / D + eps)[:, None]


@triton.jit
def _normed_and_unrotated(x1, x2, xt, g1, g2, rstd, c1, s1, c2, s2, hm, pm):
    """The backwards' shared step for a token's head rows: the normed rows x * rstd (zero in
    masked heads and pairs) and the gradient rotated back by -theta, dz = R(-theta) g, for the
    pair halves; the tail's dz is its gradient itself."""
    xh1 = tl.where(hm & pm, x1 * rstd, 0.0)
    xh2 = tl.where(hm & pm, x2 * rstd, 0.0)
    xht = tl.where(hm, xt * rstd, 0.0)
    return xh1, xh2, xht, g1 * c1 + g2 * s2, g2 * c2 - g1 * s1


@triton.jit
def _forward_heads(x_ptr, o_ptr, w_ptr, b, s, h0, n_heads, c1, s1, c2, s2, eps,
                   sxb, sxs, sxh, sxd, sob, sos, soh, sod, sw,
                   D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr,
                   TAIL_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
                   GEMMA: tl.constexpr, HAS_TAIL: tl.constexpr):
    """Norm then rotate heads h0 .. h0 + BLOCK_H - 1 of one token."""
    h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    hm = h < n_heads
    x1, x2, xt = _load_rows(x_ptr + b * sxb + s * sxs + h * sxh, sxd, hm, D, HALF, PAIR_BLOCK,
                            TAIL_BLOCK, INTERLEAVED, HAS_TAIL)
    w1, w2, wt = _weights(w_ptr, sw, D, HALF, PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, GEMMA)
    rstd = _rstd(x1, x2, xt, eps, D)
    z1 = x1 * rstd * w1
    z2 = x2 * rstd * w2
    zt = xt * rstd * wt
    y1 = z1 * c1 - z2 * s1
    y2 = z2 * c2 + z1 * s2
    _store_rows(o_ptr + b * sob + s * sos + h * soh, sod, hm, y1, y2, zt, D, HALF, PAIR_BLOCK,
                TAIL_BLOCK, INTERLEAVED, HAS_TAIL)


@triton.jit
def qk_norm_rope_fwd_kernel(
        q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, inv_ptr, pos_ptr,
        S, HQ, HK, Q_BLOCKS, BLOCKS, rows, eps,
        sqb, sqs, sqh, sqd, skb, sks, skh, skd,
        sqob, sqos, sqoh, sqod, skob, skos, skoh, skod,
        sqw, skw, tsr, tsc, psb, pss,
        D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
        BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, INTERLEAVED: tl.constexpr,
        TABLE: tl.constexpr, HAS_POS: tl.constexpr, GEMMA: tl.constexpr,
        HAS_TAIL: tl.constexpr):
    """Grid (tokens * BLOCKS,), BLOCKS = q head blocks + k head blocks, a token's blocks adjacent
    (its cos/sin row is read once from DRAM, then from L2): y = RoPE(rmsnorm(x) * w) for q and
    k."""
    pid = tl.program_id(0).to(tl.int64)
    tok = pid // BLOCKS
    hb = (pid - tok * BLOCKS).to(tl.int32)
    b = tok // S
    s = tok - b * S
    c1, s1, c2, s2 = _angles(b, s, True, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows,
                             tsr, tsc, HALF, PAIR_BLOCK, INTERLEAVED, TABLE, HAS_POS)
    if hb < Q_BLOCKS:
        _forward_heads(q_ptr, qo_ptr, qw_ptr, b, s, hb.to(tl.int64) * BLOCK_HQ, HQ,
                       c1, s1, c2, s2, eps, sqb, sqs, sqh, sqd, sqob, sqos, sqoh, sqod, sqw,
                       D, HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_HQ, INTERLEAVED, GEMMA, HAS_TAIL)
    else:
        _forward_heads(k_ptr, ko_ptr, kw_ptr, b, s, (hb - Q_BLOCKS).to(tl.int64) * BLOCK_HK, HK,
                       c1, s1, c2, s2, eps, skb, sks, skh, skd, skob, skos, skoh, skod, skw,
                       D, HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_HK, INTERLEAVED, GEMMA, HAS_TAIL)


@triton.jit
def _backward_heads(x_ptr, g_ptr, dx_ptr, w_ptr, part_ptr, part_row, tok0, token_step, T, S, h0,
                    n_heads, eps, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr, tsc,
                    sxb, sxs, sxh, sxd, sgb, sgs, sgh, sgd, sdb, sds, sdh, sdd, sw,
                    D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr,
                    TAIL_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
                    TABLE: tl.constexpr, HAS_POS: tl.constexpr, GEMMA: tl.constexpr,
                    HAS_TAIL: tl.constexpr, tokens_per_program, STAGES: tl.constexpr,
                    MINIMAL: tl.constexpr):
    """dx for heads h0 .. h0 + BLOCK_H - 1 of the tokens tok0 + i * token_step, i below
    tokens_per_program, and their weight-gradient partial sum as row ``part_row`` of the
    [programs, D] buffer. STAGES > 1 asks Triton's pipeliner to issue a later token's loads while
    a token is computed. MINIMAL: the minimal kernel (experiments; not the gradients): the norm
    and the rotation replaced by a multiply-add per element that keeps every load (x, dy, cos
    and sin) and store, the partial rows and the loop as they are."""
    h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    w1, w2, wt = _weights(w_ptr, sw, D, HALF, PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, GEMMA)
    j, o1, o2 = _members(HALF, PAIR_BLOCK, INTERLEAVED)
    pm = j < HALF
    # dz * x_hat summed per lane over the tokens, over the heads once at the end (a reduction
    # across warps in every token's step would stall the loop on a barrier)
    acc1 = tl.zeros([BLOCK_H, PAIR_BLOCK], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, PAIR_BLOCK], dtype=tl.float32)
    acct = tl.zeros([BLOCK_H, TAIL_BLOCK], dtype=tl.float32)
    for i in tl.range(tokens_per_program, num_stages=STAGES):
        tok = tok0 + i * token_step
        valid = tok < T
        b = tok // S
        s = tok - b * S
        hm = (h < n_heads) & valid
        c1, s1, c2, s2 = _angles(b, s, valid, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr,
                                 rows, tsr, tsc, HALF, PAIR_BLOCK, INTERLEAVED, TABLE, HAS_POS)
        x1, x2, xt = _load_rows(x_ptr + b * sxb + s * sxs + h * sxh, sxd, hm, D, HALF,
                                PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)
        g1, g2, gt = _load_rows(g_ptr + b * sgb + s * sgs + h * sgh, sgd, hm, D, HALF,
                                PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)
        if MINIMAL:
            acc1 += x1 * c1
            acc2 += x2 * c2
            acct += xt
            _store_rows(dx_ptr + b * sdb + s * sds + h * sdh, sdd, hm, g1 + x1 * s1,
                        g2 + x2 * s2, gt + xt, D, HALF, PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED,
                        HAS_TAIL)
        else:
            rstd = _rstd(x1, x2, xt, eps, D)
            xh1, xh2, xht, dz1, dz2 = _normed_and_unrotated(x1, x2, xt, g1, g2, rstd, c1, s1,
                                                            c2, s2, hm, pm)
            acc1 += dz1 * xh1
            acc2 += dz2 * xh2
            acct += gt * xht
            dxh1 = dz1 * w1
            dxh2 = dz2 * w2
            dxht = gt * wt
            dot = (tl.sum(dxh1 * xh1, axis=1) + tl.sum(dxh2 * xh2, axis=1)
                   + tl.sum(dxht * xht, axis=1))[:, None] / D
            _store_rows(dx_ptr + b * sdb + s * sds + h * sdh, sdd, hm,
                        rstd * (dxh1 - xh1 * dot), rstd * (dxh2 - xh2 * dot),
                        rstd * (dxht - xht * dot), D, HALF, PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED,
                        HAS_TAIL)
    prow = part_ptr + part_row * D
    tl.store(prow + o1, tl.sum(acc1, axis=0)[None, :], mask=pm)
    tl.store(prow + o2, tl.sum(acc2, axis=0)[None, :], mask=pm)
    if HAS_TAIL:
        t = 2 * HALF + tl.arange(0, TAIL_BLOCK)[None, :]
        tl.store(prow + t, tl.sum(acct, axis=0)[None, :], mask=t < D)


@triton.jit
def qk_norm_rope_bwd_kernel(
        q_ptr, k_ptr, gq_ptr, gk_ptr, dq_ptr, dk_ptr, qw_ptr, kw_ptr, qpart_ptr, kpart_ptr,
        cos_ptr, sin_ptr, inv_ptr, pos_ptr,
        T, S, HQ, HK, Q_BLOCKS, K_BLOCKS, rows, eps, tokens_per_program,
        sqb, sqs, sqh, sqd, skb, sks, skh, skd,
        sgqb, sgqs, sgqh, sgqd, sgkb, sgks, sgkh, sgkd,
        sdqb, sdqs, sdqh, sdqd, sdkb, sdks, sdkh, sdkd,
        sqw, skw, tsr, tsc, psb, pss,
        D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
        BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, INTERLEAVED: tl.constexpr,
        TABLE: tl.constexpr, HAS_POS: tl.constexpr, GEMMA: tl.constexpr, HAS_TAIL: tl.constexpr,
        STAGES: tl.constexpr, PDL: tl.constexpr, MINIMAL: tl.constexpr = False):
    """Grid (token groups, q head blocks + k head blocks): dq, dk and the weight-gradient
    partial rows (q: row ``group * Q_BLOCKS + block``; k likewise with K_BLOCKS). Group g takes
    tokens g, g + groups, g + 2 * groups, ...: the programs running at one time read and write
    neighbouring tokens, as a copy would. Contiguous runs of tokens (g * tokens_per_program on)
    were 2-4% slower (H100, bf16, Qwen3-8B's heads, 3 programs per SM: 51.9, 190.5 and 374.8 us
    against 50.9, 186.1 and 367.3 at 4k, 4 x 4k and 32k tokens; one run, 2026-11-27).
    A head block's groups are adjacent here, unlike the forward's grid: with a group's head
    blocks adjacent instead, the backward took 7% longer at Qwen3-8B's 4 x 4096 tokens (H100,
    bf16, 2048 elements, 16 contiguous tokens a program: 228.9 against 213.5 us in one run)."""
    _let_dependents_launch(PDL)
    grp = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    token_step = tl.num_programs(0).to(tl.int64)
    if hb < Q_BLOCKS:
        _backward_heads(q_ptr, gq_ptr, dq_ptr, qw_ptr, qpart_ptr, grp * Q_BLOCKS + hb, grp,
                        token_step, T, S, hb.to(tl.int64) * BLOCK_HQ, HQ, eps, pos_ptr, psb, pss,
                        cos_ptr, sin_ptr, inv_ptr, rows, tsr, tsc, sqb, sqs, sqh, sqd,
                        sgqb, sgqs, sgqh, sgqd, sdqb, sdqs, sdqh, sdqd, sqw,
                        D, HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_HQ, INTERLEAVED, TABLE, HAS_POS,
                        GEMMA, HAS_TAIL, tokens_per_program, STAGES, MINIMAL)
    else:
        kb = hb - Q_BLOCKS
        _backward_heads(k_ptr, gk_ptr, dk_ptr, kw_ptr, kpart_ptr, grp * K_BLOCKS + kb, grp,
                        token_step, T, S, kb.to(tl.int64) * BLOCK_HK, HK, eps, pos_ptr, psb, pss,
                        cos_ptr, sin_ptr, inv_ptr, rows, tsr, tsc, skb, sks, skh, skd,
                        sgkb, sgks, sgkh, sgkd, sdkb, sdks, sdkh, sdkd, skw,
                        D, HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_HK, INTERLEAVED, TABLE, HAS_POS,
                        GEMMA, HAS_TAIL, tokens_per_program, STAGES, MINIMAL)


# ---- norm over all heads of a token (OLMo2) ---------------------------------------------------
# The weight has heads * D elements (row h of it for head h); the mean square is over the token's
# heads * D channels. A program takes every head of one tensor (grid y: 0 = q, 1 = k) for one
# token (forward) or TOKENS_PER_PROGRAM tokens (backward). WHOLE_TOKEN: all its heads in one block
# of BLOCK_H, each row read once; else in blocks of BLOCK_H heads, its rows read twice: once for
# the token's sums, once to write.


@triton.jit
def _head_weights(w_ptr, sw, h, hm, D: tl.constexpr, HALF: tl.constexpr,
                  PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
                  GEMMA: tl.constexpr, HAS_TAIL: tl.constexpr):
    """Rows h of a ``[heads * D]`` weight, [BLOCK_H, *] fp32 pieces (``1 + w`` for Gemma)."""
    w1, w2, wt = _load_rows(w_ptr + h * D * sw, sw, hm, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                            INTERLEAVED, HAS_TAIL)
    if GEMMA:
        w1 = w1 + 1.0
        w2 = w2 + 1.0
        wt = wt + 1.0
    return w1, w2, wt


@triton.jit
def _sum_all(a):
    return tl.sum(tl.sum(a, axis=1), axis=0)


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _token_sums(x1, x2, xt, v1, v2, vt, HAS_TAIL: tl.constexpr):
    """``(sum(x^2), sum(v * x))`` over a block of rows [BLOCK_H, *] (pair members, tail), the
    backward's two sums a token, reduced together: one exchange across the program's warps for
    both. Six separate sums took 18 barriers a token in the TMA backward's loop, these 9 (sm_90,
    Triton 3.6, Qwen3-8B's 32 heads of 128 in bf16 on 4 warps); the backward took 194.0 us at 4 x
    4k tokens against 198.0 (H100, one machine start). Rows with an unrotated tail keep the six
    sums: together, the one-pass plain-load build with computed fp16 angles and nothing known of
    its strides spilled 4-20 bytes under Triton 3.8 (the sm_90 compile test's)."""
    if HAS_TAIL:
        return (_sum_all(x1 * x1) + _sum_all(x2 * x2) + _sum_all(xt * xt),
                _sum_all(v1 * x1) + _sum_all(v2 * x2) + _sum_all(vt * xt))
    a, b = tl.reduce((x1 * x1 + x2 * x2, v1 * x1 + v2 * x2), 1, _add_pairs)
    return tl.reduce((a, b), 0, _add_pairs)


@triton.jit
def _rotate_store(x1, x2, xt, rstd, w1, w2, wt, o_ptr, sod, hm, c1, s1, c2, s2,
                  D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr,
                  TAIL_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_TAIL: tl.constexpr):
    """Rows of the output: ``RoPE(x * rstd * w)``, given the weight's pieces."""
    z1 = x1 * rstd * w1
    z2 = x2 * rstd * w2
    zt = xt * rstd * wt
    y1 = z1 * c1 - z2 * s1
    y2 = z2 * c2 + z1 * s2
    _store_rows(o_ptr, sod, hm, y1, y2, zt, D, HALF, PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED,
                HAS_TAIL)


@triton.jit
def _norm_rotate_store(x1, x2, xt, rstd, w_ptr, o_ptr, sw, sod, h, hm, c1, s1, c2, s2,
                       D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr,
                       TAIL_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr, GEMMA: tl.constexpr,
                       HAS_TAIL: tl.constexpr):
    """Rows h of the output: ``RoPE(x * rstd * w)``, with rows h of the ``[heads * D]`` weight."""
    w1, w2, wt = _head_weights(w_ptr, sw, h, hm, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                               INTERLEAVED, GEMMA, HAS_TAIL)
    _rotate_store(x1, x2, xt, rstd, w1, w2, wt, o_ptr, sod, hm, c1, s1, c2, s2, D, HALF,
                  PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)


@triton.jit
def _token_sum_squares(x1, x2, xt, HAS_TAIL: tl.constexpr, ROW_SUMS: tl.constexpr):
    """``sum(x^2)`` over a token's rows. ``ROW_SUMS``: each row's sum, then the rows' (one
    reduction across the program's warps); else each piece's whole sum. With q and k in one
    program both forms take 167-168 registers (sm_90, Triton 3.6, Qwen3-8B's heads in bf16 on 2
    warps); with q and k apart the row sums take 168 against 136, so two programs fewer fit an
    SM."""
    if ROW_SUMS:
        rows = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if HAS_TAIL:
            rows += tl.sum(xt * xt, axis=1)
        return tl.sum(rows, axis=0)
    else:
        return _sum_all(x1 * x1) + _sum_all(x2 * x2) + _sum_all(xt * xt)


@triton.jit
def _whole_rows(x_ptr, w_ptr, b, s, n_heads, sxb, sxs, sxh, sxd, sw,
                D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr,
                TAIL_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
                GEMMA: tl.constexpr, HAS_TAIL: tl.constexpr):
    """Every head row of one token, ``(mask, w1, w2, wt, x1, x2, xt)``: the weight's loads
    first, so that their round trip to the L2 overlaps the rows' from DRAM instead of following
    the token's sum (results/README.md, "OLMo2's norm forward: the weights before the rows, q
    and k in one program")."""
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    hm = h < n_heads
    w1, w2, wt = _head_weights(w_ptr, sw, h, hm, D, HALF, PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED,
                               GEMMA, HAS_TAIL)
    x1, x2, xt = _load_rows(x_ptr + b * sxb + s * sxs + h * sxh, sxd, hm, D, HALF, PAIR_BLOCK,
                            TAIL_BLOCK, INTERLEAVED, HAS_TAIL)
    return hm, w1, w2, wt, x1, x2, xt


@triton.jit
def _whole_rows_out(hm, w1, w2, wt, x1, x2, xt, o_ptr, b, s, n_heads, eps, sob, sos, soh, sod,
                    c1, s1, c2, s2, D: tl.constexpr, HALF: tl.constexpr,
                    PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                    INTERLEAVED: tl.constexpr, HAS_TAIL: tl.constexpr, ROW_SUMS: tl.constexpr):
    """:func:`_whole_rows`' token normalised over all its heads, rotated and written."""
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    rstd = tl.rsqrt(_token_sum_squares(x1, x2, xt, HAS_TAIL, ROW_SUMS) / (n_heads * D) + eps)
    _rotate_store(x1, x2, xt, rstd, w1, w2, wt, o_ptr + b * sob + s * sos + h * soh, sod, hm,
                  c1, s1, c2, s2, D, HALF, PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)


@triton.jit
def _forward_token_in_blocks(x_ptr, o_ptr, w_ptr, b, s, n_heads, c1, s1, c2, s2, eps,
                             sxb, sxs, sxh, sxd, sob, sos, soh, sod, sw,
                             D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr,
                             TAIL_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                             INTERLEAVED: tl.constexpr, GEMMA: tl.constexpr,
                             HAS_TAIL: tl.constexpr):
    """Norm over all heads of one token, then rotate each head, in two passes over blocks of
    heads: the first sums the token's squares, the second reads the rows again to write."""
    x_row = x_ptr + b * sxb + s * sxs
    o_row = o_ptr + b * sob + s * sos
    ss = tl.zeros([1, 1], dtype=tl.float32)
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
        hm = h < n_heads
        x1, x2, xt = _load_rows(x_row + h * sxh, sxd, hm, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                                INTERLEAVED, HAS_TAIL)
        ss += _sum_all(x1 * x1) + _sum_all(x2 * x2) + _sum_all(xt * xt)
    rstd = tl.rsqrt(ss / (n_heads * D) + eps)
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
        hm = h < n_heads
        x1, x2, xt = _load_rows(x_row + h * sxh, sxd, hm, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                                INTERLEAVED, HAS_TAIL)
        _norm_rotate_store(x1, x2, xt, rstd, w_ptr, o_row + h * soh, sw, sod, h, hm,
                           c1, s1, c2, s2, D, HALF, PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED,
                           GEMMA, HAS_TAIL)


@triton.jit
def qk_token_norm_rope_fwd_kernel(
        q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, inv_ptr, pos_ptr,
        S, HQ, HK, rows, eps,
        sqb, sqs, sqh, sqd, skb, sks, skh, skd,
        sqob, sqos, sqoh, sqod, skob, skos, skoh, skod,
        sqw, skw, tsr, tsc, psb, pss,
        D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
        BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, INTERLEAVED: tl.constexpr,
        TABLE: tl.constexpr, HAS_POS: tl.constexpr, GEMMA: tl.constexpr,
        HAS_TAIL: tl.constexpr, WHOLE_TOKEN: tl.constexpr, QK_TOGETHER: tl.constexpr):
    """y = RoPE(rmsnorm over the token's heads(x) * w) for q and k. ``WHOLE_TOKEN`` (every
    head of q in one block of BLOCK_HQ, and of k in one of BLOCK_HK): each row read once and
    kept in registers; with ``QK_TOGETHER`` grid (tokens, 1), a token's q and k in one program
    (both tensors' loads in flight before either's sum), else grid (tokens, 2), q (y 0) and k
    (y 1). Otherwise grid (tokens, 2), q and k in blocks of heads, each row read twice."""
    tok = tl.program_id(0).to(tl.int64)
    b = tok // S
    s = tok - b * S
    c1, s1, c2, s2 = _angles(b, s, True, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows,
                             tsr, tsc, HALF, PAIR_BLOCK, INTERLEAVED, TABLE, HAS_POS)
    if WHOLE_TOKEN:
        if QK_TOGETHER:
            qm, qw1, qw2, qwt, q1, q2, qt = _whole_rows(
                q_ptr, qw_ptr, b, s, HQ, sqb, sqs, sqh, sqd, sqw, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                BLOCK_HQ, INTERLEAVED, GEMMA, HAS_TAIL)
            km, kw1, kw2, kwt, k1, k2, kt = _whole_rows(
                k_ptr, kw_ptr, b, s, HK, skb, sks, skh, skd, skw, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                BLOCK_HK, INTERLEAVED, GEMMA, HAS_TAIL)
            _whole_rows_out(qm, qw1, qw2, qwt, q1, q2, qt, qo_ptr, b, s, HQ, eps,
                            sqob, sqos, sqoh, sqod, c1, s1, c2, s2, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                            BLOCK_HQ, INTERLEAVED, HAS_TAIL, QK_TOGETHER)
            _whole_rows_out(km, kw1, kw2, kwt, k1, k2, kt, ko_ptr, b, s, HK, eps,
                            skob, skos, skoh, skod, c1, s1, c2, s2, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                            BLOCK_HK, INTERLEAVED, HAS_TAIL, QK_TOGETHER)
        elif tl.program_id(1) == 0:
            qm, qw1, qw2, qwt, q1, q2, qt = _whole_rows(
                q_ptr, qw_ptr, b, s, HQ, sqb, sqs, sqh, sqd, sqw, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                BLOCK_HQ, INTERLEAVED, GEMMA, HAS_TAIL)
            _whole_rows_out(qm, qw1, qw2, qwt, q1, q2, qt, qo_ptr, b, s, HQ, eps,
                            sqob, sqos, sqoh, sqod, c1, s1, c2, s2, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                            BLOCK_HQ, INTERLEAVED, HAS_TAIL, QK_TOGETHER)
        else:
            km, kw1, kw2, kwt, k1, k2, kt = _whole_rows(
                k_ptr, kw_ptr, b, s, HK, skb, sks, skh, skd, skw, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                BLOCK_HK, INTERLEAVED, GEMMA, HAS_TAIL)
            _whole_rows_out(km, kw1, kw2, kwt, k1, k2, kt, ko_ptr, b, s, HK, eps,
                            skob, skos, skoh, skod, c1, s1, c2, s2, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                            BLOCK_HK, INTERLEAVED, HAS_TAIL, QK_TOGETHER)
    elif tl.program_id(1) == 0:
        _forward_token_in_blocks(q_ptr, qo_ptr, qw_ptr, b, s, HQ, c1, s1, c2, s2, eps,
                                 sqb, sqs, sqh, sqd, sqob, sqos, sqoh, sqod, sqw,
                                 D, HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_HQ, INTERLEAVED, GEMMA,
                                 HAS_TAIL)
    else:
        _forward_token_in_blocks(k_ptr, ko_ptr, kw_ptr, b, s, HK, c1, s1, c2, s2, eps,
                                 skb, sks, skh, skd, skob, skos, skoh, skod, skw,
                                 D, HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_HK, INTERLEAVED, GEMMA,
                                 HAS_TAIL)


@triton.jit
def _store_partial_rows(row_ptr, hh, acc1, acc2, acct, D: tl.constexpr, HALF: tl.constexpr,
                        PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                        INTERLEAVED: tl.constexpr, HAS_TAIL: tl.constexpr):
    """A block of heads' weight-gradient sums [BLOCK_H, *] (pair members, tail) into its fp32
    partial rows at ``row_ptr`` (``[BLOCK_H, 1]`` pointers, one row of D a head)."""
    j, o1, o2 = _members(HALF, PAIR_BLOCK, INTERLEAVED)
    pm = hh & (j < HALF)
    tl.store(row_ptr + o1, acc1, mask=pm)
    tl.store(row_ptr + o2, acc2, mask=pm)
    if HAS_TAIL:
        t = 2 * HALF + tl.arange(0, TAIL_BLOCK)[None, :]
        tl.store(row_ptr + t, acct, mask=hh & (t < D))


@triton.jit
def _backward_token(x_ptr, g_ptr, dx_ptr, w_ptr, part_ptr, grp, tok0, T, S, n_heads, eps,
                    pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr, tsc, sxb, sxs, sxh,
                    sxd, sgb, sgs, sgh, sgd, sdb, sds, sdh, sdd, sw, D: tl.constexpr,
                    HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, TABLE: tl.constexpr,
                    HAS_POS: tl.constexpr, GEMMA: tl.constexpr, HAS_TAIL: tl.constexpr,
                    TOKENS_PER_PROGRAM: tl.constexpr, WHOLE_TOKEN: tl.constexpr,
                    STAGES: tl.constexpr):
    """dx of every head of tokens tok0 .. tok0 + TOKENS_PER_PROGRAM - 1, and their weight-gradient
    partial sums as row ``grp`` of the [programs, heads * D] buffer: ``WHOLE_TOKEN`` (every head in
    one block), one pass a token (:func:`_backward_whole_tokens`); else two passes over blocks of
    heads.

    Pass 1, per token: ``sum(x^2)`` and ``sum(dx_hat * x)`` over its heads give ``rstd`` and
    ``mean(dx_hat * x_hat) = rstd * sum(dx_hat * x) / N``, kept in two [TOKENS_PER_PROGRAM]
    registers. Pass 2, per block of heads, over the tokens: dx, and the block's dweight rows
    summed in registers. Pass 2 reads the program's tokens again: from DRAM once the resident
    programs' TOKENS_PER_PROGRAM tokens outgrow the L2."""
    if WHOLE_TOKEN:
        _backward_whole_tokens(x_ptr, g_ptr, dx_ptr, w_ptr, part_ptr, grp, tok0, T, S, n_heads,
                               eps, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr, tsc,
                               sxb, sxs, sxh, sxd, sgb, sgs, sgh, sgd, sdb, sds, sdh, sdd, sw, D,
                               HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_H, INTERLEAVED, TABLE, HAS_POS,
                               GEMMA, HAS_TAIL, TOKENS_PER_PROGRAM, STAGES)
    else:
        n = n_heads * D
        slots = tl.arange(0, TOKENS_PER_PROGRAM)
        rstds = tl.zeros([TOKENS_PER_PROGRAM], dtype=tl.float32)
        dots = tl.zeros([TOKENS_PER_PROGRAM], dtype=tl.float32)
        for i in range(TOKENS_PER_PROGRAM):
            tok = tok0 + i
            valid = tok < T
            b = tok // S
            s = tok - b * S
            c1, s1, c2, s2 = _angles(b, s, valid, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr,
                                     rows, tsr, tsc, HALF, PAIR_BLOCK, INTERLEAVED, TABLE, HAS_POS)
            ss = tl.zeros([1, 1], dtype=tl.float32)
            sd = tl.zeros([1, 1], dtype=tl.float32)
            for h0 in range(0, n_heads, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
                hm = (h < n_heads) & valid
                x1, x2, xt = _load_rows(x_ptr + b * sxb + s * sxs + h * sxh, sxd, hm, D, HALF,
                                        PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)
                g1, g2, gt = _load_rows(g_ptr + b * sgb + s * sgs + h * sgh, sgd, hm, D, HALF,
                                        PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)
                w1, w2, wt = _head_weights(w_ptr, sw, h, hm, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                                           INTERLEAVED, GEMMA, HAS_TAIL)
                dz1 = g1 * c1 + g2 * s2
                dz2 = g2 * c2 - g1 * s1
                block_ss, block_sd = _token_sums(x1, x2, xt, dz1 * w1, dz2 * w2, gt * wt,
                                                 HAS_TAIL)
                ss += block_ss
                sd += block_sd
            rstd = tl.rsqrt(ss / n + eps)
            dot = rstd * sd / n
            rstds = tl.where(slots == i, tl.sum(tl.sum(rstd, axis=1), axis=0), rstds)
            dots = tl.where(slots == i, tl.sum(tl.sum(dot, axis=1), axis=0), dots)
        j, o1, o2 = _members(HALF, PAIR_BLOCK, INTERLEAVED)
        pm = j < HALF
        for h0 in range(0, n_heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
            hh = h < n_heads
            w1, w2, wt = _head_weights(w_ptr, sw, h, hh, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                                       INTERLEAVED, GEMMA, HAS_TAIL)
            acc1 = tl.zeros([BLOCK_H, PAIR_BLOCK], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_H, PAIR_BLOCK], dtype=tl.float32)
            acct = tl.zeros([BLOCK_H, TAIL_BLOCK], dtype=tl.float32)
            for i in range(TOKENS_PER_PROGRAM):
                tok = tok0 + i
                valid = tok < T
                b = tok // S
                s = tok - b * S
                hm = hh & valid
                rstd = tl.sum(tl.where(slots == i, rstds, 0.0), axis=0)
                dot = tl.sum(tl.where(slots == i, dots, 0.0), axis=0)
                c1, s1, c2, s2 = _angles(b, s, valid, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr,
                                         rows, tsr, tsc, HALF, PAIR_BLOCK, INTERLEAVED, TABLE,
                                         HAS_POS)
                x1, x2, xt = _load_rows(x_ptr + b * sxb + s * sxs + h * sxh, sxd, hm, D, HALF,
                                        PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)
                g1, g2, gt = _load_rows(g_ptr + b * sgb + s * sgs + h * sgh, sgd, hm, D, HALF,
                                        PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)
                xh1, xh2, xht, dz1, dz2 = _normed_and_unrotated(x1, x2, xt, g1, g2, rstd, c1,
                                                                s1, c2, s2, hm, pm)
                acc1 += dz1 * xh1
                acc2 += dz2 * xh2
                acct += gt * xht
                _store_rows(dx_ptr + b * sdb + s * sds + h * sdh, sdd, hm,
                            rstd * (dz1 * w1 - xh1 * dot), rstd * (dz2 * w2 - xh2 * dot),
                            rstd * (gt * wt - xht * dot), D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                            INTERLEAVED, HAS_TAIL)
            _store_partial_rows(part_ptr + grp * n + h * D, hh, acc1, acc2, acct, D, HALF,
                                PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)


@triton.jit
def _backward_whole_tokens(x_ptr, g_ptr, dx_ptr, w_ptr, part_ptr, grp, tok0, T, S, n_heads, eps,
                           pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr, tsc, sxb, sxs,
                           sxh, sxd, sgb, sgs, sgh, sgd, sdb, sds, sdh, sdd, sw,
                           D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr,
                           TAIL_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                           INTERLEAVED: tl.constexpr, TABLE: tl.constexpr, HAS_POS: tl.constexpr,
                           GEMMA: tl.constexpr, HAS_TAIL: tl.constexpr,
                           TOKENS_PER_PROGRAM: tl.constexpr, STAGES: tl.constexpr):
    """:func:`_backward_token` with every head of a token in one block (n_heads <= BLOCK_H):
    per token, its rows of x and dy are read once, the sums, dx and the dweight terms all come
    from the registers. With plain loads Triton's pipeliner stages none of a later token's rows
    (:func:`_backward_tokens_tma` reads them through TMA descriptors instead).

    Its per-token lines repeat pass 2 of :func:`_backward_token`: sharing them through helper
    functions reordered the instructions, and ptxas then spilled registers in the two-pass
    kernel (bf16, sm_90)."""
    n = n_heads * D
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    hh = h < n_heads
    j, o1, o2 = _members(HALF, PAIR_BLOCK, INTERLEAVED)
    pm = j < HALF
    acc1 = tl.zeros([BLOCK_H, PAIR_BLOCK], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, PAIR_BLOCK], dtype=tl.float32)
    acct = tl.zeros([BLOCK_H, TAIL_BLOCK], dtype=tl.float32)
    for i in tl.range(TOKENS_PER_PROGRAM, num_stages=STAGES):
        valid, b, s, c1, s1, c2, s2 = _token_at(tok0 + i, T, S, pos_ptr, psb, pss, cos_ptr,
                                                sin_ptr, inv_ptr, rows, tsr, tsc, HALF,
                                                PAIR_BLOCK, INTERLEAVED, TABLE, HAS_POS)
        hm = hh & valid
        x1, x2, xt = _load_rows(x_ptr + b * sxb + s * sxs + h * sxh, sxd, hm, D, HALF,
                                PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)
        g1, g2, gt = _load_rows(g_ptr + b * sgb + s * sgs + h * sgh, sgd, hm, D, HALF,
                                PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)
        w1, w2, wt = _head_weights(w_ptr, sw, h, hh, D, HALF, PAIR_BLOCK, TAIL_BLOCK,
                                   INTERLEAVED, GEMMA, HAS_TAIL)
        dz1 = g1 * c1 + g2 * s2
        dz2 = g2 * c2 - g1 * s1
        ss, sd = _token_sums(x1, x2, xt, dz1 * w1, dz2 * w2, gt * wt, HAS_TAIL)
        rstd = tl.rsqrt(ss / n + eps)
        dot = rstd * sd / n
        xh1 = tl.where(hm & pm, x1 * rstd, 0.0)
        xh2 = tl.where(hm & pm, x2 * rstd, 0.0)
        xht = tl.where(hm, xt * rstd, 0.0)
        acc1 += dz1 * xh1
        acc2 += dz2 * xh2
        acct += gt * xht
        _store_rows(dx_ptr + b * sdb + s * sds + h * sdh, sdd, hm, rstd * (dz1 * w1 - xh1 * dot),
                    rstd * (dz2 * w2 - xh2 * dot), rstd * (gt * wt - xht * dot), D, HALF,
                    PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)
    _store_partial_rows(part_ptr + grp * n + h * D, hh, acc1, acc2, acct, D, HALF,
                        PAIR_BLOCK, TAIL_BLOCK, INTERLEAVED, HAS_TAIL)


@triton.jit
def _tma_weights(w_desc, HALF: tl.constexpr, GEMMA: tl.constexpr):
    """A token-norm weight's pair members [heads, HALF] as fp32, through its descriptor."""
    w1 = w_desc.load([0, 0]).to(tl.float32)
    w2 = w_desc.load([0, HALF]).to(tl.float32)
    if GEMMA:
        w1 = w1 + 1.0
        w2 = w2 + 1.0
    return w1, w2


@triton.jit
def _tma_token_step(x_desc, g_desc, dx_desc, b, s, w1, w2, acc1, acc2, n, eps, c1, s1, c2, s2,
                    BLOCK_H: tl.constexpr, HALF: tl.constexpr, TAIL_BLOCK: tl.constexpr):
    """One token of one tensor in :func:`_backward_tokens_tma`: its rows of x and dy through
    their descriptors, the token's two sums, dx out through ``dx_desc``; returns the dweight
    terms ``dz * x_hat`` added to (acc1, acc2)."""
    x1, x2, xt = _load_rows_tma(x_desc, b, s, BLOCK_H, HALF, TAIL_BLOCK)
    g1, g2, gt = _load_rows_tma(g_desc, b, s, BLOCK_H, HALF, TAIL_BLOCK)
    dz1 = g1 * c1 + g2 * s2
    dz2 = g2 * c2 - g1 * s1
    ss, sd = _token_sums(x1, x2, xt, dz1 * w1, dz2 * w2, gt, False)
    rstd = tl.rsqrt(ss / n + eps)
    dot = rstd * sd / n
    xh1 = x1 * rstd
    xh2 = x2 * rstd
    _store_rows_tma(dx_desc, b, s, rstd * (dz1 * w1 - xh1 * dot), rstd * (dz2 * w2 - xh2 * dot),
                    BLOCK_H, HALF)
    return acc1 + dz1 * xh1, acc2 + dz2 * xh2


@triton.jit
def _backward_tokens_tma(xa_desc, ga_desc, dxa_desc, wa_desc, pa_desc, xb_desc, gb_desc,
                         dxb_desc, wb_desc, pb_desc, grp, tok0, T, S, na, nb, eps, pos_ptr, psb,
                         pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr, tsc, tokens_per_program,
                         HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                         BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, TABLE: tl.constexpr,
                         HAS_POS: tl.constexpr, GEMMA: tl.constexpr, STAGES: tl.constexpr,
                         TWO: tl.constexpr):
    """The whole-token backward (rotate-half, no tail) through TMA descriptors, for one tensor (a: q
    or k) or, ``TWO``, for two (a: q, b: k) in one loop: per token, the angles once, then each
    tensor's rows, sums and dx (:func:`_tma_token_step`); ``na``, ``nb``: each tensor's channels
    (heads * D). ``tokens_per_program`` is a runtime count: the launcher spreads the tokens over
    every SM without a compile per count. x and dy come through ``*x_desc`` and ``*g_desc``
    (:func:`_load_rows_tma`), and STAGES > 1 keeps later tokens' rows in flight in shared memory
    while a token is computed; each weight comes once through ``*w_desc`` (``[heads, D]``), dx
    leaves through ``*dx_desc`` and the partial row through ``*p_desc`` (``[programs, heads, D]``).
    Rows past the tensors read as 0 and are not written, so no lane needs a mask. Why every one:
    where Triton cannot prove a launch's strides divisible by 16, a pointer load or store fixes its
    tensor's register layout (the weight's fp32 rows one, dx's 16-bit rows another) and the loop
    computes the token twice, once in each layout; through descriptors it has one. ptxas, sm_90,
    Triton 3.6, Qwen3-8B's 32 heads of 128 in bf16 on 4 warps, strides not known divisible (the
    sm_90 compile test's build): 255 registers and 244 bytes spilled with pointers, 168 and none so.
    With strides divisible by 16 (Qwen3-8B's launch) both have one layout: 168 registers, 4 and 0
    bytes spilled."""
    wa1, wa2 = _tma_weights(wa_desc, HALF, GEMMA)
    acca1 = tl.zeros([BLOCK_A, HALF], dtype=tl.float32)
    acca2 = tl.zeros([BLOCK_A, HALF], dtype=tl.float32)
    if TWO:
        wb1, wb2 = _tma_weights(wb_desc, HALF, GEMMA)
        accb1 = tl.zeros([BLOCK_B, HALF], dtype=tl.float32)
        accb2 = tl.zeros([BLOCK_B, HALF], dtype=tl.float32)
    for i in tl.range(tokens_per_program, num_stages=STAGES):
        valid, b, s, c1, s1, c2, s2 = _token_at(tok0 + i, T, S, pos_ptr, psb, pss, cos_ptr,
                                                sin_ptr, inv_ptr, rows, tsr, tsc, HALF,
                                                PAIR_BLOCK, False, TABLE, HAS_POS)
        acca1, acca2 = _tma_token_step(xa_desc, ga_desc, dxa_desc, b, s, wa1, wa2, acca1, acca2,
                                       na, eps, c1, s1, c2, s2, BLOCK_A, HALF, TAIL_BLOCK)
        if TWO:
            accb1, accb2 = _tma_token_step(xb_desc, gb_desc, dxb_desc, b, s, wb1, wb2, accb1,
                                           accb2, nb, eps, c1, s1, c2, s2, BLOCK_B, HALF,
                                           TAIL_BLOCK)
    gi = grp.to(tl.int32)
    pa_desc.store([gi, 0, 0], acca1.reshape(1, BLOCK_A, HALF))
    pa_desc.store([gi, 0, HALF], acca2.reshape(1, BLOCK_A, HALF))
    if TWO:
        pb_desc.store([gi, 0, 0], accb1.reshape(1, BLOCK_B, HALF))
        pb_desc.store([gi, 0, HALF], accb2.reshape(1, BLOCK_B, HALF))


@triton.jit
def qk_token_norm_rope_bwd_kernel(
        q_ptr, k_ptr, gq_ptr, gk_ptr, q_desc, k_desc, gq_desc, gk_desc, dq_desc, dk_desc,
        qw_desc, kw_desc, qpart_desc, kpart_desc, dq_ptr, dk_ptr, qw_ptr, kw_ptr, qpart_ptr,
        kpart_ptr, cos_ptr, sin_ptr, inv_ptr, pos_ptr,
        T, S, HQ, HK, rows, eps, tma_tokens,
        sqb, sqs, sqh, sqd, skb, sks, skh, skd,
        sgqb, sgqs, sgqh, sgqd, sgkb, sgks, sgkh, sgkd,
        sdqb, sdqs, sdqh, sdqd, sdkb, sdks, sdkh, sdkd,
        sqw, skw, tsr, tsc, psb, pss,
        D: tl.constexpr, HALF: tl.constexpr, PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
        BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, INTERLEAVED: tl.constexpr,
        TABLE: tl.constexpr, HAS_POS: tl.constexpr, GEMMA: tl.constexpr, HAS_TAIL: tl.constexpr,
        TOKENS_PER_PROGRAM: tl.constexpr, WHOLE_TOKEN: tl.constexpr, TMA: tl.constexpr,
        QK_TOGETHER: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """Grid (token groups, 2): dq (y 0) or dk (y 1) and the weight-gradient partial row
    ``group`` of ``[groups, heads * D]``, group g the tokens from g * TOKENS_PER_PROGRAM on;
    ``WHOLE_TOKEN``: every head of q in one block of BLOCK_HQ, and of k in one of BLOCK_HK;
    ``TMA`` (whole tokens only): q, k, dq_out, dk_out, dq, dk, the weights and the partial rows
    through the ten descriptors (None otherwise), ``tma_tokens`` tokens a group (a runtime
    count; TOKENS_PER_PROGRAM unused); ``QK_TOGETHER`` (TMA only): grid (token groups, 1), each
    program a token's q and k."""
    _let_dependents_launch(PDL)
    grp = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    if TMA:
        tok0 = grp * tma_tokens
    else:
        tok0 = grp * TOKENS_PER_PROGRAM
    if TMA:
        if QK_TOGETHER:
            _backward_tokens_tma(q_desc, gq_desc, dq_desc, qw_desc, qpart_desc, k_desc, gk_desc,
                                 dk_desc, kw_desc, kpart_desc, grp, tok0, T, S, HQ * D, HK * D,
                                 eps, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr,
                                 tsc, tma_tokens, HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_HQ,
                                 BLOCK_HK, TABLE, HAS_POS, GEMMA, STAGES, True)
        elif which == 0:
            _backward_tokens_tma(q_desc, gq_desc, dq_desc, qw_desc, qpart_desc, q_desc, gq_desc,
                                 dq_desc, qw_desc, qpart_desc, grp, tok0, T, S, HQ * D, HQ * D,
                                 eps, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr,
                                 tsc, tma_tokens, HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_HQ,
                                 BLOCK_HQ, TABLE, HAS_POS, GEMMA, STAGES, False)
        else:
            _backward_tokens_tma(k_desc, gk_desc, dk_desc, kw_desc, kpart_desc, k_desc, gk_desc,
                                 dk_desc, kw_desc, kpart_desc, grp, tok0, T, S, HK * D, HK * D,
                                 eps, pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr,
                                 tsc, tma_tokens, HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_HK,
                                 BLOCK_HK, TABLE, HAS_POS, GEMMA, STAGES, False)
    elif which == 0:
        _backward_token(q_ptr, gq_ptr, dq_ptr, qw_ptr, qpart_ptr, grp, tok0, T, S, HQ, eps,
                        pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr, tsc,
                        sqb, sqs, sqh, sqd, sgqb, sgqs, sgqh, sgqd, sdqb, sdqs, sdqh, sdqd, sqw,
                        D, HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_HQ, INTERLEAVED, TABLE, HAS_POS,
                        GEMMA, HAS_TAIL, TOKENS_PER_PROGRAM, WHOLE_TOKEN, STAGES)
    else:
        _backward_token(k_ptr, gk_ptr, dk_ptr, kw_ptr, kpart_ptr, grp, tok0, T, S, HK, eps,
                        pos_ptr, psb, pss, cos_ptr, sin_ptr, inv_ptr, rows, tsr, tsc,
                        skb, sks, skh, skd, sgkb, sgks, sgkh, sgkd, sdkb, sdks, sdkh, sdkd, skw,
                        D, HALF, PAIR_BLOCK, TAIL_BLOCK, BLOCK_HK, INTERLEAVED, TABLE, HAS_POS,
                        GEMMA, HAS_TAIL, TOKENS_PER_PROGRAM, WHOLE_TOKEN, STAGES)


# ---- the weight gradients: the partial rows' column sums ----------------------------------------
@triton.jit
def _column_sums(part_ptr, out_ptr, rows, cols, c0, BLOCK_R: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """Columns c0 .. c0 + BLOCK_C - 1 of a contiguous fp32 ``[rows, cols]`` buffer summed over its
    rows, in a fixed order, rounded once to the output's dtype."""
    c = c0 + tl.arange(0, BLOCK_C)[None, :]
    cm = c < cols
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, rows, BLOCK_R):
        r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
        acc += tl.load(part_ptr + r * cols + c, mask=(r < rows) & cm, other=0.0)
    tl.store(out_ptr + c, tl.sum(acc, axis=0)[None, :].to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def weight_grad_kernel(qpart_ptr, kpart_ptr, dqw_ptr, dkw_ptr, q_rows, k_rows, q_cols, k_cols,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """Grid (column blocks, 2): dq_weight (y 0) and dk_weight (y 1) from the backward's partial
    rows, both in one launch. ``PDL``: launched as the backward's programmatic dependent, it
    waits (``griddepcontrol.wait``) until the backward's grid has ended and its writes are
    visible."""
    if PDL:
        tl_cuda.gdc_wait()
    c0 = tl.program_id(0) * BLOCK_C
    if tl.program_id(1) == 0:
        if c0 < q_cols:
            _column_sums(qpart_ptr, dqw_ptr, q_rows, q_cols, c0, BLOCK_R, BLOCK_C)
    else:
        if c0 < k_cols:
            _column_sums(kpart_ptr, dkw_ptr, k_rows, k_cols, c0, BLOCK_R, BLOCK_C)


__all__ = ["TABLE_COMPUTED", "TABLE_FULL", "TABLE_HALF", "qk_norm_rope_fwd_kernel",
           "qk_norm_rope_bwd_kernel", "qk_token_norm_rope_fwd_kernel",
           "qk_token_norm_rope_bwd_kernel", "weight_grad_kernel"]
