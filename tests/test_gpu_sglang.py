"""The SGLang port on the GPU, against the float64 oracle of the tables it is given.

Through the registry: both conventions, every head dim of the cache path (64, 128, 256, 512),
fp16 and bf16, GQA/MQA k, partial rotary, per-token ids, packed varlen (thd), q and k cut from a
packed qkv; the any-head-size kernel on head size 80 (fp32, fp16, bf16), partial rotary,
asymmetric rotate-half tables and q alone. Directly: both grids of the cache path (head-parallel
below one wave, sequential heads above), the fused KV-cache store (rotated k and v at cache_loc,
every other row untouched, with and without enable_pdl), the added refusals, and the kernels'
bounds where the host checks are skipped or cannot run (inside a CUDA-graph capture): a position
outside the cache gives its token NaN in the rotated lanes, a cache_loc outside the buffers
leaves them untouched (NaN guard rows on either side of the buffers). Outputs are
poisoned (NaN) first by the runner, so an element the kernel leaves unwritten fails; the fused
store's buffers are NaN-filled here for the same reason. Where sgl_kernel is importable, the
port is checked against it bit for bit (it is not installed on our GPU machine: the test skips).
"""
from __future__ import annotations

import importlib

import pytest
import torch

from ports import registry, sglang
from ports.harness.runner import run_case
from ports.sglang import _launch
from reference.case import RopeCase
from reference.oracle import rope_oracle
from reference.tables import first_members, rope_tables
from reference.tolerances import tolerance

pytestmark = pytest.mark.gpu

CACHE = "sglang.cos_sin_cache_inplace"
ANY = "sglang.rotary_embedding"
GQA = RopeCase(2, 37, 8, 128, kv_heads=2, dtype="bf16", positions="ids", label="sglang")
H80 = RopeCase(1, 300, 16, 80, kv_heads=16, dtype="fp16", cos_sin_dtype="same",
               style="interleaved", base=1e6, label="head 80")
CASES = [
    (CACHE, GQA), (CACHE, GQA.replace(dtype="fp16", style="interleaved")),
    (CACHE, GQA.replace(head_dim=64)), (CACHE, GQA.replace(head_dim=256, kv_heads=1)),
    (CACHE, GQA.replace(head_dim=512, style="interleaved")),
    (CACHE, GQA.replace(rotary_dim=64)), (CACHE, GQA.replace(rotary_dim=40, style="interleaved")),
    (CACHE, GQA.replace(contiguous=False)), (CACHE, GQA.replace(cos_sin_dtype="same")),
    (CACHE, RopeCase(4, 50, 8, 128, kv_heads=8, layout="thd", seqlens=(50, 1, 17, 30),
                     dtype="bf16", style="interleaved")),
    (CACHE, RopeCase(2, 4096, 32, 128, kv_heads=8, dtype="bf16", label="8k tokens")),
    (ANY, H80), (ANY, H80.replace(style="rotate_half")), (ANY, H80.replace(dtype="bf16")),
    (ANY, H80.replace(dtype="fp32")), (ANY, H80.replace(rotary_dim=40)),
    (ANY, H80.replace(style="rotate_half", asymmetric=True)), (ANY, H80.replace(kv_heads=None)),
    (ANY, H80.replace(kv_heads=4, layout="thd", batch=2, seqlens=(300, 7), positions="ids")),
    (ANY, RopeCase(2, 33, 6, 64, kv_heads=2, dtype="bf16", cos_sin_dtype="same")),
]


@pytest.mark.parametrize("name, case", CASES, ids=lambda v: v if isinstance(v, str)
                         else v.describe())
def test_port_matches_the_oracle(name, case):
    spec = registry.get(name)
    assert spec.unsupported_reason(case) is None
    rep = run_case(case, [spec], timing_on=False)
    assert all(r.status == "ok" for r in rep.results), [(r.impl, r.reason) for r in rep.results]


def _inputs(nnz, hq, hk, d, dtype, rows=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(nnz, hq * d, generator=g) + 0.5).to(dtype).cuda()
    k = (torch.randn(nnz, hk * d, generator=g) + 0.5).to(dtype).cuda()
    pos = torch.randint(0, rows, (nnz,), generator=g).cuda()
    cos, sin = rope_tables(rows, d)
    cache = torch.cat([cos[:, : d // 2], sin[:, : d // 2]], -1).contiguous().cuda()
    return q, k, pos, cache, cos, sin


def _expect(x, cos, sin, pos, d):
    return rope_oracle(x.view(x.shape[0], -1, d).cpu(), cos, sin, pos.cpu(), layout="thd",
                       style="rotate_half")


@pytest.mark.parametrize("nnz", [3, 20000])
def test_both_grids_are_taken_and_correct(nnz):
    """3 tokens: 1 block, far below a wave; 20000 tokens: 2500 blocks of 8 tokens, above a wave
    on any H100/H200 (at most 16 blocks of 128 threads per SM x 132 SMs = 2112)."""
    d = 128
    q, k, pos, cache, cos, sin = _inputs(nnz, 8, 2, d, torch.bfloat16)
    _, bdx, bdy = _launch.vector_layout(d, 2)
    name = _launch.cache_kernel_name(False, False, False, d, torch.bfloat16)
    per_sm = _launch.occupancy(name, q.device.index, bdx * bdy)
    head_parallel = _launch.use_head_parallel(nnz, bdy, per_sm, _launch.num_sms(q.device.index))
    assert head_parallel == (nnz == 3)
    ref_q, ref_k = _expect(q, cos, sin, pos, d), _expect(k, cos, sin, pos, d)
    sglang.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cache)
    for out, ref in ((q, ref_q), (k, ref_k)):
        err = (out.view(ref.shape).cpu().double() - ref).abs()
        assert (err <= tolerance(ref, torch.bfloat16, steps=1.0)).all(), float(err.max())


@pytest.mark.parametrize("enable_pdl", [None, True, False])
@pytest.mark.parametrize("nnz", [5, 20000])
def test_fused_kv_cache_store(nnz, enable_pdl):
    d, hk, rows = 128, 4, 3 * 20000
    q, k, pos, cache, cos, sin = _inputs(nnz, 16, hk, d, torch.float16)
    v = (torch.randn(nnz, hk * d) + 0.5).half().cuda()
    k_buffer = torch.full((rows, hk * d), float("nan"), dtype=torch.float16, device="cuda")
    v_buffer = torch.full_like(k_buffer, float("nan"))
    loc = torch.randperm(rows, device="cuda")[:nnz]
    ref_k = _expect(k, cos, sin, pos, d)
    v_before = v.clone()
    arg = sglang.FusedSetKVBufferArg(v, k_buffer, v_buffer, None, None, loc)
    sglang.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cache, True, arg, enable_pdl)
    err = (k.view(ref_k.shape).cpu().double() - ref_k).abs()
    assert (err <= tolerance(ref_k, torch.float16, steps=1.0)).all(), float(err.max())
    assert torch.equal(k_buffer[loc], k)          # the same rounded values as k_rope
    assert torch.equal(v_buffer[loc], v_before) and torch.equal(v, v_before)
    untouched = torch.ones(rows, dtype=torch.bool, device="cuda")
    untouched[loc] = False
    assert torch.isnan(k_buffer[untouched]).all() and torch.isnan(v_buffer[untouched]).all()


def test_refusals_on_the_device():
    d = 128
    q, k, pos, cache, _, _ = _inputs(8, 4, 4, d, torch.bfloat16, rows=16)
    with pytest.raises(ValueError, match="pos_ids must lie"):
        sglang.apply_rope_with_cos_sin_cache_inplace(pos + 16, q, k, d, cache)
    with pytest.raises(NotImplementedError, match="rotary_embedding"):
        sglang.apply_rope_with_cos_sin_cache_inplace(pos, q[:, : 4 * 80], k[:, : 4 * 80], 80,
                                                     cache[:, :80].contiguous())
    sglang.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cache)  # the context is fine
    torch.cuda.synchronize()


def test_repeat_runs_are_deterministic():
    d = 256
    q, k, pos, cache, _, _ = _inputs(513, 8, 2, d, torch.bfloat16)
    q2, k2 = q.clone(), k.clone()
    sglang.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cache, is_neox=False)
    sglang.apply_rope_with_cos_sin_cache_inplace(pos, q2, k2, d, cache, is_neox=False)
    assert torch.equal(q, q2) and torch.equal(k, k2)


def _sgl_kernel():
    try:
        return importlib.import_module("sgl_kernel")
    except Exception as exc:
        pytest.skip(f"sgl_kernel is not importable here ({type(exc).__name__}): the bit-for-bit "
                    "check needs pip install sgl-kernel")


@pytest.mark.parametrize("is_neox", [True, False])
def test_bit_for_bit_against_sgl_kernel(is_neox):
    """The same fp32 math, fast-math build and rounding: identical bits expected."""
    sgl = _sgl_kernel()
    d = 128
    q, k, pos, cache, _, _ = _inputs(1000, 32, 8, d, torch.bfloat16)
    q2, k2 = q.clone(), k.clone()
    sglang.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cache, is_neox)
    sgl.apply_rope_with_cos_sin_cache_inplace(pos, q2, k2, d, cache, is_neox)
    assert torch.equal(q, q2) and torch.equal(k, k2)


def test_any_head_bit_for_bit_against_sgl_kernel():
    sgl = _sgl_kernel()
    if not hasattr(sgl, "rotary_embedding"):
        pytest.skip("this sgl_kernel has no rotary_embedding (multimodal) op")
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(300, 16 * 80, generator=g) + 0.5).half().cuda()
    k = (torch.randn(300, 16 * 80, generator=g) + 0.5).half().cuda()
    cos = torch.rand(300, 40, generator=g).half().cuda()
    sin = torch.rand(300, 40, generator=g).half().cuda()
    q2, k2 = q.clone(), k.clone()
    sglang.rotary_embedding(cos, sin, q, k, 80, True)
    sgl.rotary_embedding(cos, sin, q2, k2, 80, True)
    assert torch.equal(q, q2) and torch.equal(k, k2)


def _bounds_inputs(nnz, is_neox, rows, kv_rows, d=128, r=64, hq=4, hk=2, seed=3):
    """fp16 q, k, v of ``nnz`` tokens; a cache of ``rows`` rows and rotary width ``r`` (of head
    ``d``); KV buffers as views with a NaN guard row on either side (k_buffer ``kv_rows`` rows,
    v_buffer 4 more, so ``kv_rows`` is inside v_buffer but past k_buffer); positions with the
    first one negative and the last one past the cache; cache_loc with the second past k_buffer
    and the third negative."""
    style = "rotate_half" if is_neox else "interleaved"
    g = torch.Generator().manual_seed(seed)
    x = lambda h: (torch.randn(nnz, h * d, generator=g) + 0.5).half().cuda()  # noqa: E731
    q, k, v = x(hq), x(hk), x(hk)
    cos, sin = rope_tables(rows, r, style=style)
    cache = torch.cat([first_members(cos, style), first_members(sin, style)], -1)
    pos = torch.randint(0, rows, (nnz,), generator=g)
    pos[0], pos[-1] = -1, rows
    loc = torch.randperm(kv_rows, generator=g)[:nnz]
    loc[1], loc[2] = kv_rows, -1
    guarded = lambda n: torch.full((n + 2, hk * d), float("nan"), dtype=torch.float16,  # noqa: E731
                                   device="cuda")
    k_backing, v_backing = guarded(kv_rows), guarded(kv_rows + 4)
    return (q, k, v, cache.contiguous().cuda(), cos, sin, pos.cuda(), loc.cuda(), k_backing,
            v_backing, style)


def _bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("nnz", [5, 20000])
def test_skipped_host_checks_leave_the_kernel_bounds(nnz, is_neox, fused):
    """``check_positions_on_host=False`` / ``check_cache_loc_on_host=False`` (the original's work,
    no sync), on both grids (5 tokens head-parallel, 20000 sequential), both styles, with and
    without the fused store, partial rotary (64 of 128): a token whose position lies outside the
    cache gets NaN in its rotated lanes and its other lanes unchanged; a token whose cache_loc
    lies outside the buffers (past k_buffer though inside v_buffer, or negative) is rotated but
    stored nowhere: every buffer row but the valid tokens' and the guard rows on either side
    stay NaN; every other token is rotated and stored as with the checks."""
    d, r, rows, kv_rows = 128, 64, 64, 3 * nnz
    q, k, v, cache, cos, sin, pos, loc, k_backing, v_backing, style = _bounds_inputs(
        nnz, is_neox, rows, kv_rows, d, r)
    k_buffer, v_buffer = k_backing[1:-1], v_backing[1:-1]
    arg = sglang.FusedSetKVBufferArg(v, k_buffer, v_buffer, None, None, loc) if fused else None
    call = sglang.apply_rope_with_cos_sin_cache_inplace
    with pytest.raises(ValueError, match="pos_ids must lie"):
        call(pos, q, k, d, cache, is_neox, arg, check_cache_loc_on_host=False)
    if fused:
        with pytest.raises(ValueError, match=r"kv_cache_loc must lie in \[0, %d\)" % kv_rows):
            call(pos, q, k, d, cache, is_neox, arg, check_positions_on_host=False)
    _, bdx, bdy = _launch.vector_layout(d, 2)
    seq = _launch.cache_kernel_name(False, fused, not is_neox, d, torch.float16)
    per_sm = _launch.occupancy(seq, q.device.index, bdx * bdy)
    assert _launch.use_head_parallel(nnz, bdy, per_sm, _launch.num_sms(q.device.index)) == (
        nnz == 5)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    call(pos, q, k, d, cache, is_neox, arg, check_positions_on_host=False,
         check_cache_loc_on_host=False)
    torch.cuda.synchronize()
    good = torch.arange(1, nnz - 1)  # in-range positions (tokens 1 and 2 have bad cache_loc)
    for out, before in ((q, q0), (k, k0)):
        out3, before3 = out.view(nnz, -1, d), before.view(nnz, -1, d)
        assert torch.isnan(out3[[0, -1], :, :r]).all()
        assert torch.equal(_bits(out3[[0, -1], :, r:]), _bits(before3[[0, -1], :, r:]))
        ref = rope_oracle(before3[good].cpu(), cos, sin, pos[good].cpu(), layout="thd",
                          style=style)
        err = (out3[good].cpu().double() - ref).abs()
        assert (err <= tolerance(ref, torch.float16, steps=1.0)).all(), float(err.max())
    if not fused:
        return
    assert torch.equal(v, v0)
    stored = torch.cat([torch.tensor([0]), torch.arange(3, nnz)]).cuda()  # tokens with good loc
    assert torch.equal(_bits(k_buffer[loc[stored]]), _bits(k[stored]))  # NaN rows included
    assert torch.equal(_bits(v_buffer[loc[stored]]), _bits(v0[stored]))
    for backing, buffer in ((k_backing, k_buffer), (v_backing, v_buffer)):
        untouched = torch.ones(backing.size(0), dtype=torch.bool, device="cuda")
        untouched[1 + loc[stored]] = False
        assert torch.isnan(backing[untouched]).all()  # guards, row kv_rows of v_buffer included


def test_bounds_under_cuda_graph_capture():
    """The host cannot read positions or cache_loc while a graph is captured (the checks are
    skipped even when asked for): the kernels bound them instead. Captured with valid indices,
    replayed with the last position past the cache and the second cache_loc past k_buffer: the
    last token's rotated lanes are NaN, the second token is rotated but stored nowhere, the
    buffers' guard rows stay NaN, the rest is rotated and stored."""
    nnz, d, r, rows, kv_rows = 8, 128, 128, 64, 24
    q, k, v, cache, cos, sin, pos, loc, k_backing, v_backing, style = _bounds_inputs(
        nnz, True, rows, kv_rows, d, r)
    pos[0], pos[-1] = 3, 5
    loc.copy_(torch.arange(nnz, device="cuda") * 3)  # distinct rows 0, 3, ..., 21 of 24
    q0, k0 = q.clone(), k.clone()
    k_buffer, v_buffer = k_backing[1:-1], v_backing[1:-1]
    arg = sglang.FusedSetKVBufferArg(v, k_buffer, v_buffer, None, None, loc)

    def fn():  # the host checks asked for (the default)
        sglang.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cache, True, arg)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs' writes first
    with torch.cuda.stream(stream):
        fn()  # warm-up (compiles) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    k_backing.fill_(float("nan"))
    v_backing.fill_(float("nan"))
    q.copy_(q0)
    k.copy_(k0)
    pos[-1], loc[1] = rows, kv_rows  # one past the cache; one past k_buffer
    graph.replay()
    torch.cuda.synchronize()
    q3, k3 = q.view(nnz, -1, d), k.view(nnz, -1, d)
    assert torch.isnan(q3[-1]).all() and torch.isnan(k3[-1]).all()
    assert not torch.isnan(q3[:-1]).any() and not torch.isnan(k3[:-1]).any()
    for out, before in ((q3, q0), (k3, k0)):
        ref = rope_oracle(before.view(nnz, -1, d)[:-1].cpu(), cos, sin, pos[:-1].cpu(),
                          layout="thd", style=style)
        err = (out[:-1].cpu().double() - ref).abs()
        assert (err <= tolerance(ref, torch.float16, steps=1.0)).all(), float(err.max())
    stored = torch.tensor([0, 2, 3, 4, 5, 6, 7], device="cuda")  # tokens with a valid cache_loc
    assert torch.equal(_bits(k_buffer[loc[stored]]), _bits(k[stored]))
    assert torch.equal(_bits(v_buffer[loc[stored]]), _bits(v[stored]))
    for backing in (k_backing, v_backing):
        untouched = torch.ones(backing.size(0), dtype=torch.bool, device="cuda")
        untouched[1 + loc[stored]] = False
        assert torch.isnan(backing[untouched]).all()  # guards, row 24 of v_buffer included
