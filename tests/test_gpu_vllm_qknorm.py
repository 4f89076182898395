"""The vLLM ``fused_qk_norm_rope`` port on the GPU, against the float64 oracle of per-head RMSNorm
then RoPE (reference/qk_norm.py), with the tolerance of one rounding after fp32 math.

Both kernels (one head a warp; 2, 4 and 8 heads a warp through cp.async) on fp16 and bf16 qkv,
fp32/fp16/bf16 caches, head_dim 64, 128 and 256, NeoX and GPT-J, GPT-J partial rotary, GQA, random
positions; the heads-per-warp choices bitwise equal to each other; v's columns bit-exact
untouched; a 32k-token prefill with the op's own choice; positions past the cache refused on the
host, and under CUDA-graph capture written as NaN for that token alone. The op works in place on
qkv, so there is no separate output to poison: every q and k element is compared, and v's are
checked unchanged.
"""
from __future__ import annotations

import pytest
import torch

from ports import vllm_port
from reference.qk_norm import forward_tolerance, qk_norm_rope_oracle, rms_norm
from reference.tables import expand_half

pytestmark = pytest.mark.gpu

EPS = 1e-6
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _inputs(t, hq, hk, hv, d, rot, dtype, cache_dtype, seed=0, rows=4096):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + hk + hv) * d, generator=g) + 0.25).to(dtype)
    qw = (0.5 * torch.randn(d, generator=g) + 1).to(dtype)
    kw = (0.5 * torch.randn(d, generator=g) + 1).to(dtype)
    inv = 10000.0 ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(rows, dtype=torch.float64)[:, None] * inv
    cache = torch.cat([ang.cos(), ang.sin()], -1).to(cache_dtype)
    pos = torch.randint(0, rows, (t,), generator=g)
    return [x.cuda() for x in (qkv, qw, kw, cache, pos)]


def _check(out, qkv0, qw, kw, cache, pos, hq, hk, d, is_neox, what):
    t, rot = qkv0.shape[0], cache.shape[1]
    style = "rotate_half" if is_neox else "interleaved"
    c64 = cache.double()
    cos = expand_half(c64[:, : rot // 2], style)
    sin = expand_half(c64[:, rot // 2:], style)
    for name, lo, h, w in (("q", 0, hq, qw), ("k", hq, hk, kw)):
        x = qkv0[:, lo * d:(lo + h) * d].reshape(t, h, d)
        got = out[:, lo * d:(lo + h) * d].reshape(t, h, d).double()
        ref = qk_norm_rope_oracle(x, w, EPS, cos, sin, pos, layout="thd", style=style)
        tol = forward_tolerance(ref, rms_norm(x, w, EPS), x.dtype, d)
        assert not got.isnan().any(), f"{what} {name}: NaN"
        err = (got - ref).abs()
        assert (err <= tol).all(), \
            f"{what} {name}: max err {float(err.max()):.3e} > tolerance {float(tol):.3e}"
    v0 = qkv0[:, (hq + hk) * d:]
    assert torch.equal(out[:, (hq + hk) * d:], v0), f"{what}: v changed"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("cache_dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("forced", [1, 2, 4, 8])
def test_matches_the_oracle(dtype, cache_dtype, is_neox, forced):
    t, hq, hk, hv, d = 67, 12, 4, 4, 128  # 67 tokens x 16 heads: a partial last chunk and block
    qkv, qw, kw, cache, pos = _inputs(t, hq, hk, hv, d, d, DT[dtype], DT[cache_dtype])
    qkv0 = qkv.clone()
    assert vllm_port.fused_qk_norm_rope(qkv, hq, hk, hv, d, EPS, qw, kw, cache, is_neox, pos,
                                        forced) is None
    _check(qkv, qkv0, qw, kw, cache, pos, hq, hk, d, is_neox, f"{dtype}/{cache_dtype}/{forced}")


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("is_neox", [True, False])
def test_other_head_dims(d, is_neox):
    t, hq, hk, hv = 33, 8, 2, 2
    qkv, qw, kw, cache, pos = _inputs(t, hq, hk, hv, d, d, torch.bfloat16, torch.float32, seed=1)
    for forced in (1, 4):
        q = qkv.clone()
        vllm_port.fused_qk_norm_rope(q, hq, hk, hv, d, EPS, qw, kw, cache, is_neox, pos, forced)
        _check(q, qkv, qw, kw, cache, pos, hq, hk, d, is_neox, f"d{d}/{forced}")


@pytest.mark.parametrize("rot", [32, 64, 96])
def test_gptj_partial_rotary(rot):
    """GPT-J rotates the first ``rot`` channels; the rest are normalised only."""
    t, hq, hk, hv, d = 40, 8, 8, 0, 128
    qkv, qw, kw, cache, pos = _inputs(t, hq, hk, hv, d, rot, torch.float16, torch.float32, seed=2)
    for forced in (1, 8):
        q = qkv.clone()
        vllm_port.fused_qk_norm_rope(q, hq, hk, hv, d, EPS, qw, kw, cache, False, pos, forced)
        _check(q, qkv, qw, kw, cache, pos, hq, hk, d, False, f"rot {rot}/{forced}")


def test_heads_per_warp_are_bitwise_equal():
    t, hq, hk, hv, d = 300, 32, 8, 8, 128
    qkv, qw, kw, cache, pos = _inputs(t, hq, hk, hv, d, d, torch.bfloat16, torch.bfloat16, seed=3)
    outs = []
    for forced in (1, 2, 4, 8, -1):
        q = qkv.clone()
        vllm_port.fused_qk_norm_rope(q, hq, hk, hv, d, EPS, qw, kw, cache, True, pos, forced)
        outs.append(q)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_32k_prefill_with_the_ops_choice():
    t, hq, hk, hv, d = 32768, 32, 8, 8, 128
    qkv, qw, kw, cache, pos = _inputs(t, hq, hk, hv, d, d, torch.bfloat16, torch.float32, seed=4,
                                      rows=40960)
    qkv0 = qkv.clone()
    vllm_port.fused_qk_norm_rope(qkv, hq, hk, hv, d, EPS, qw, kw, cache, True, pos)
    _check(qkv, qkv0, qw, kw, cache, pos, hq, hk, d, True, "32k")


def test_positions_past_the_cache():
    t, hq, hk, hv, d = 8, 4, 2, 2, 128
    qkv, qw, kw, cache, pos = _inputs(t, hq, hk, hv, d, d, torch.bfloat16, torch.float32, seed=5,
                                      rows=64)
    bad = pos.clone()
    bad[3] = 64
    with pytest.raises(ValueError, match="valid positions are 0..63"):
        vllm_port.fused_qk_norm_rope(qkv.clone(), hq, hk, hv, d, EPS, qw, kw, cache, True, bad)
    for forced in (1, 4):
        # Compiled and launched once outside the capture (a capture takes no module load).
        vllm_port.fused_qk_norm_rope(qkv.clone(), hq, hk, hv, d, EPS, qw, kw, cache, True, pos,
                                     forced)
        out = qkv.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the inputs' writes first
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            vllm_port.fused_qk_norm_rope(out, hq, hk, hv, d, EPS, qw, kw, cache, True, bad,
                                         forced)
        graph.replay()
        torch.cuda.synchronize()
        qk = out[:, : (hq + hk) * d]
        assert qk[3].isnan().all(), "the bad token's rotated channels must be NaN"
        keep = torch.ones(t, dtype=torch.bool, device="cuda")
        keep[3] = False
        _check(out[keep], qkv[keep], qw, kw, cache, pos[keep], hq, hk, d, True,
               f"graph/{forced}")
