"""The vLLM port on the GPU, against the float64 oracle and the op's float64 semantics
(tests/_vllm_reference.py).

Through the registry: bshd, sbhd and thd, NeoX and GPT-J, partial rotary, GQA and MQA k, fp32 and
x-dtype caches, ids and offset positions, q and k cut from a packed qkv. Directly: the op's own
forms and features (q alone, ``[T, h * d]`` and ``[b, s, ...]`` tensors, token and head strides
with NaN-filled gaps that must stay untouched, ``rope_dim_offset``, ``inverse``, a cache in another
dtype than q), determinism, a 32k-token prefill, the refusal of positions past the cache and the
kernel's bound under CUDA-graph capture, and a bit-for-bit check against the installed vLLM op
where it imports. The op is in place only (no out-of-place form to test).
"""
from __future__ import annotations

import pytest
import torch

from _vllm_reference import cache_for, rotate_tokens
from ports import registry, vllm_port
from ports.harness.runner import run_case
from reference.case import RopeCase
from reference.tolerances import tolerance

pytestmark = pytest.mark.gpu

BASE = RopeCase(2, 37, 8, 64, dtype="bf16", kv_heads=2, label="vllm_port")
CASES = [
    BASE, BASE.replace(dtype="fp16"), BASE.replace(dtype="fp32"),
    BASE.replace(style="interleaved"), BASE.replace(cos_sin_dtype="same"),
    BASE.replace(rotary_dim=32), BASE.replace(layout="sbhd", style="interleaved", rotary_dim=48),
    BASE.replace(positions="ids", max_position=4096), BASE.replace(positions="offset",
                                                                    max_position=512),
    BASE.replace(kv_heads=1), BASE.replace(kv_heads=None), BASE.replace(contiguous=False),
    BASE.replace(heads=64, kv_heads=8, head_dim=128),  # block capped at 512 threads: loops
    RopeCase(4, 50, 4, 80, layout="thd", seqlens=(50, 1, 17, 30), dtype="fp16", kv_heads=4),
    RopeCase(1, 32768, 32, 128, dtype="bf16", cos_sin_dtype="same", kv_heads=8,
             label="32k prefill"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.describe())
def test_vllm_port_matches_the_oracle(case):
    spec = registry.get("vllm_port.rotary_embedding")
    assert spec.unsupported_reason(case) is None
    rep = run_case(case, [spec], timing_on=False)
    assert all(r.status == "ok" for r in rep.results), [(r.impl, r.reason) for r in rep.results]


def _check(got, x, pos, cache, dtype, **kw):
    ref = rotate_tokens(x.cpu(), pos.cpu().reshape(-1), cache.cpu(), **kw)
    got = got.cpu().double()
    assert not torch.isnan(got).any()
    err = (got - ref).abs()
    assert (err <= tolerance(ref, dtype, steps=2.0)).all(), float(err.max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("is_neox", [True, False])
def test_strided_views_offset_and_inverse(dtype, is_neox):
    """q ``[T, h, d]`` cut from a wider buffer (token stride padded), k ``[T, h_k * d]`` flat
    with its own token stride (the kernel steps q's and k's heads by one head stride, query's:
    a k of another head stride is refused: test_vllm_port.py); rope_dim_offset 16
    and rot_dim 64 in d=128; the gaps are NaN and must stay NaN; the channels outside the
    rotation stay bit-exact."""
    t, h, hk, d, rot, off = 33, 8, 2, 128, 64, 16
    qbuf = torch.full((t, h * d + 8), float("nan"), device="cuda", dtype=dtype)
    kbuf = torch.full((t, hk * d + 24), float("nan"), device="cuda", dtype=dtype)
    q, k = qbuf[:, :h * d].view(t, h, d), kbuf[:, :hk * d]
    q.copy_(torch.randn(t, h, d)), k.copy_(torch.randn(t, hk * d))
    q0, k0 = q.clone(), k.clone()
    pos = torch.randint(0, 2048, (t,), device="cuda")
    cache = cache_for(2048, rot).cuda()
    for inverse in (False, True):
        q.copy_(q0), k.copy_(k0)
        assert vllm_port.rotary_embedding(pos, q, k, d, cache, is_neox, off, inverse) is None
        kw = dict(is_neox=is_neox, rope_dim_offset=off, inverse=inverse)
        _check(q, q0, pos, cache, dtype, **kw)
        _check(k.view(t, hk, d), k0.view(t, hk, d), pos, cache, dtype, **kw)
        keep = torch.ones(d, dtype=torch.bool, device="cuda")
        keep[off:off + rot] = False
        assert torch.equal(q[..., keep], q0[..., keep])
        assert torch.isnan(qbuf[:, h * d:]).all() and torch.isnan(kbuf[:, hk * d:]).all()


def test_batch_seq_positions_query_alone_and_a_cache_in_another_dtype():
    """positions ``[b, s]`` with q ``[b, s, h * d]`` and no k; a bf16 q read with an fp16 cache
    (the original's two dispatches are independent)."""
    b, s, h, d = 3, 17, 4, 64
    q = torch.randn(b, s, h * d, device="cuda", dtype=torch.bfloat16)
    q0 = q.clone()
    pos = torch.randint(0, 100, (b, s), device="cuda")
    cache = cache_for(100, d, dtype=torch.float16).cuda()
    vllm_port.rotary_embedding(pos, q, None, d, cache, False)
    _check(q.view(b * s, h, d), q0.view(b * s, h, d), pos, cache, torch.bfloat16, is_neox=False)


def test_repeated_calls_are_deterministic():
    q = torch.randn(512, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(512, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (512,), device="cuda")
    cache = cache_for(4096, 128).cuda()
    outs = []
    for _ in range(3):
        qq, kk = q.clone(), k.clone()
        vllm_port.rotary_embedding(pos, qq, kk, 128, cache, True)
        outs.append((qq, kk))
    assert all(torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1]) for a, b in outs)


def test_positions_past_the_cache_are_refused_and_nothing_is_written():
    q = torch.randn(4, 2, 32, device="cuda")
    q0 = q.clone()
    cache = cache_for(10, 32).cuda()
    for bad in ([0, 1, 2, 10], [0, -1, 2, 3]):
        with pytest.raises(ValueError, match="valid positions are 0..9"):
            vllm_port.rotary_embedding(torch.tensor(bad, device="cuda"), q, None, 32, cache, True)
    assert torch.equal(q, q0)


def test_positions_under_cuda_graph_capture():
    """The host cannot read positions while a graph is captured: the kernel bounds the cache row
    instead (valid tokens as before; a position past the cache gives NaN, no stray read)."""
    t, h, d = 8, 4, 64
    x = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
    q = x.clone()
    pos = torch.arange(t, device="cuda")
    cache = cache_for(16, d).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs' writes first
    with torch.cuda.stream(stream):
        vllm_port.rotary_embedding(pos, q.clone(), None, d, cache, True)  # compile outside
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            vllm_port.rotary_embedding(pos, q, None, d, cache, True)
    q.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    _check(q, x, pos, cache, torch.bfloat16, is_neox=True)
    q.copy_(x)
    pos[-1] = 16  # one past the table
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(q[-1]).all() and not torch.isnan(q[:-1]).any()


def test_bit_for_bit_against_the_installed_op():
    ops = pytest.importorskip("vllm._custom_ops", reason="vllm is not installed here (its wheel "
                              "is larger than the GPU machine carries)")
    for dtype, is_neox in ((torch.bfloat16, True), (torch.float16, False)):
        q = torch.randn(257, 32, 128, device="cuda", dtype=dtype)
        k = torch.randn(257, 8, 128, device="cuda", dtype=dtype)
        pos = torch.randint(0, 8192, (257,), device="cuda")
        cache = cache_for(8192, 128, dtype=dtype).cuda()
        q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
        ops.rotary_embedding(pos, q1, k1, 128, cache, is_neox)
        vllm_port.rotary_embedding(pos, q2, k2, 128, cache, is_neox)
        # Same kernel, same expression order and conversions: equal bits expected. nvcc and
        # NVRTC could contract x*cos - y*sin to an FMA differently; that would show as one
        # rounding step, which this test would then report rather than hide.
        assert torch.equal(q1, q2) and torch.equal(k1, k2)
