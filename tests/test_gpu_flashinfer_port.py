"""The FlashInfer port on the GPU, against the float64 oracle.

Through the registry (every row: both conventions, partial rotary, offsets and per-token ids,
thd, q and k cut from a packed qkv, GQA 32/8 and MQA, q alone, decode, head sizes 64 to 512, fp16
and bf16), and directly: Llama 3.1 scaling on the indptr and pos_ids paths against the reference's
``llama31_inv_freq``; the sequential and head-parallel kernels bit-identical on one input; the
strategy each shape gets on this GPU; in place equal to out of place, inputs unchanged out of
place; interleaved cache reads on the cache's last row; and, where ``flashinfer`` imports, the
port bit for bit against it. Outputs are poisoned (NaN) first, so an unwritten element fails.
"""
from __future__ import annotations

import pytest
import torch

from ports import _alloc, registry
from ports import flashinfer_port as fi
from ports.flashinfer_port import _launch
from ports.harness.runner import run_case
from reference import llama31_inv_freq
from reference.case import RopeCase
from reference.oracle import rope_oracle, rotate
from reference.tables import angles, expand_half, inv_freq
from reference.tolerances import ANGLE_REL_ERR_FAST_MATH, tolerance

pytestmark = pytest.mark.gpu

BASE = RopeCase(2, 37, 8, 128, dtype="bf16", kv_heads=2, label="flashinfer_port")
CASES = [
    BASE, BASE.replace(dtype="fp16"), BASE.replace(style="interleaved"),
    BASE.replace(rotary_dim=64), BASE.replace(rotary_dim=64, style="interleaved"),
    BASE.replace(positions="offset", max_position=4096),
    BASE.replace(positions="ids", max_position=4096, style="interleaved"),
    BASE.replace(contiguous=False), BASE.replace(heads=32, kv_heads=8),
    BASE.replace(heads=5, kv_heads=3, style="interleaved"),
    BASE.replace(kv_heads=1), BASE.replace(kv_heads=None),
    BASE.replace(head_dim=64, dtype="fp16"), BASE.replace(head_dim=256, rotary_dim=128),
    BASE.replace(head_dim=512, style="interleaved"),
    BASE.replace(cos_sin_dtype="same"),
    RopeCase(4, 50, 8, 128, layout="thd", seqlens=(50, 1, 17, 30), dtype="bf16", kv_heads=2),
    RopeCase(4, 50, 8, 128, layout="thd", seqlens=(50, 1, 17, 30), dtype="fp16", kv_heads=2,
             positions="ids", style="interleaved"),
    RopeCase(64, 1, 32, 128, dtype="bf16", kv_heads=8, positions="offset", max_position=8192),
    # 18000 tokens = 2250 token tiles: past the sequential switch on an H100 at 16 resident
    # blocks per SM (2112 tiles); test_strategy_on_this_gpu checks the switch on this GPU
    RopeCase(2, 9000, 32, 128, dtype="bf16", kv_heads=8),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.describe())
def test_rows_match_the_oracle(case):
    specs = [s for s in registry.select(["flashinfer_port"]) if s.unsupported_reason(case) is None]
    assert specs
    rep = run_case(case, specs, timing_on=False)
    assert all(r.status == "ok" for r in rep.results), [(r.impl, r.reason) for r in rep.results]


# ---- direct calls -----------------------------------------------------------------------------
def _qk(nnz, hq=8, hk=2, d=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(nnz, hq, d, device="cuda", dtype=dtype, generator=g),
            torch.randn(nnz, hk, d, device="cuda", dtype=dtype, generator=g))


def _check(out, x, freqs, positions, style, rot, fast_math=True):
    """out against the fp64 oracle with frequencies ``freqs`` ``[R/2]`` at ``positions``:
    2 rounding steps, plus the fast-math angle term where angles are computed in the kernel."""
    full = expand_half(angles(positions.cpu(), freqs), style)  # [nnz, R]: row t for token t
    ref = rope_oracle(x.cpu(), torch.cos(full), torch.sin(full), torch.arange(len(positions)),
                      layout="thd", style=style)
    x64 = x.cpu().double()
    op = x64[..., :rot].abs()
    tol = tolerance(ref, x.dtype, steps=2.0,
                    angle_rel_err=ANGLE_REL_ERR_FAST_MATH if fast_math else 0.0,
                    angle=full[:, None].expand(-1, x.shape[1], -1),
                    pair_magnitude=op + rotate(op, style).abs())
    err = (out.cpu().double() - ref).abs()
    assert not torch.isnan(out).any()
    assert (err <= tol).all(), float((err - tol).max())
    assert torch.equal(out[..., rot:].cpu(), x[..., rot:].cpu())  # the tail passes through


LLAMA = dict(rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
             old_context_len=8192)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("rot", [128, 64])
def test_llama31_pos_ids(interleave, rot):
    """Positions across Llama 3.1's 8k original context and into the scaled range (up to 32k),
    non-monotonic; the pos_ids launcher always takes the sequential kernel."""
    q, k = _qk(300)
    g = torch.Generator().manual_seed(1)
    pos = torch.randint(0, 32768, (300,), generator=g).cuda()
    with _alloc.poisoned():
        q_out, k_out = fi.apply_llama31_rope_pos_ids(q, k, pos, rotary_dim=rot,
                                                     interleave=interleave, **LLAMA)
    style = "interleaved" if interleave else "rotate_half"
    freqs = llama31_inv_freq(rot, 5e5, rope_scale=8.0)
    _check(q_out, q, freqs, pos, style, rot)
    _check(k_out, k, freqs, pos, style, rot)


@pytest.mark.parametrize("interleave", [False, True])
def test_llama31_indptr_offsets(interleave):
    lengths, offsets = [40, 1, 200], [0, 9000, 30000]
    q, k = _qk(sum(lengths), hq=4, hk=4, dtype=torch.float16)
    indptr = torch.tensor([0, 40, 41, 241], dtype=torch.int32, device="cuda")
    offs = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    q_in, k_in = q.clone(), k.clone()
    fi.apply_llama31_rope_inplace(q_in, k_in, indptr, offs, interleave=interleave, **LLAMA)
    pos = torch.cat([o + torch.arange(n) for o, n in zip(offsets, lengths)])
    style = "interleaved" if interleave else "rotate_half"
    freqs = llama31_inv_freq(128, 5e5, rope_scale=8.0)
    _check(q_in, q, freqs, pos, style, 128)
    _check(k_in, k, freqs, pos, style, 128)


def test_llama31_differs_from_plain_rope_at_long_positions():
    """A test on scaled frequencies that plain RoPE could also pass proves nothing."""
    q, k = _qk(8)
    pos = torch.full((8,), 20000, device="cuda")
    scaled = fi.apply_llama31_rope_pos_ids(q, k, pos, **LLAMA)[0]
    plain = fi.apply_rope_pos_ids(q, k, pos, rope_theta=5e5)[0]
    assert (scaled.float() - plain.float()).abs().max() > 0.1


@pytest.mark.parametrize("path", ["pos_ids", "cache"])
@pytest.mark.parametrize("interleave", [False, True])
def test_both_strategies_agree_bit_for_bit(path, interleave):
    """The sequential and head-parallel kernels do the same arithmetic per element."""
    q, k = _qk(77, hq=32, hk=8)
    pos = torch.randint(0, 4096, (77,), device="cuda")
    cache = torch.cat([torch.cos(angles(torch.arange(4096), inv_freq(128))),
                       torch.sin(angles(torch.arange(4096), inv_freq(128)))], -1).float().cuda()
    outs = []
    for strategy in ("sequential", "head_parallel"):
        q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
        if path == "pos_ids":
            got = _launch.batch_qk_apply_rotary_pos_ids(
                q, k, q_out, k_out, pos, 128, interleave, _launch.rope_parameters(1.0, 1e4),
                strategy=strategy)
        else:
            got = _launch.batch_qk_apply_rotary_cos_sin_cache(
                q, k, q_out, k_out, cache, pos, interleave, strategy=strategy)
        assert got == strategy
        outs.append((q_out, k_out))
    assert not torch.isnan(outs[0][0]).any() and not torch.isnan(outs[0][1]).any()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_strategy_on_this_gpu():
    """Decode (one token tile) runs head-parallel; a prefill of more token tiles than the GPU's
    resident blocks runs sequential heads, by the driver's occupancy for the kernel."""
    bdx, bdy = 16, 8  # head 128, 16-bit
    name = _launch._kernel("fi_pos_ids", False, 128, "__nv_bfloat16", "long long")
    per_sm, sms = _launch.device_occupancy(_launch.POS_IDS_MODULE, name, 0, bdx * bdy)
    assert per_sm >= 1 and sms == torch.cuda.get_device_properties(0).multi_processor_count
    for nnz, want in ((1, "head_parallel"), (per_sm * sms * bdy, "sequential")):
        q, k = _qk(nnz, hq=4, hk=1)
        pos = torch.arange(nnz, device="cuda")
        got = _launch.batch_qk_apply_rotary_pos_ids(q, k, q.clone(), k.clone(), pos, 128, False,
                                                    _launch.rope_parameters(1.0, 1e4))
        assert got == want


@pytest.mark.parametrize("form", ["indptr", "pos_ids", "llama31", "cache"])
def test_in_place_equals_out_of_place(form):
    q, k = _qk(64, hq=8, hk=2)
    q0, k0 = q.clone(), k.clone()
    pos = torch.randint(0, 1024, (64,), device="cuda")
    indptr = torch.tensor([0, 30, 64], device="cuda")
    offsets = torch.tensor([5, 100], device="cuda")
    cache = torch.cat([torch.cos(angles(torch.arange(1024), inv_freq(64))),
                       torch.sin(angles(torch.arange(1024), inv_freq(64)))], -1).float().cuda()
    qi, ki = q.clone(), k.clone()
    if form == "indptr":
        out = fi.apply_rope(q, k, indptr, offsets, rotary_dim=64)
        fi.apply_rope_inplace(qi, ki, indptr, offsets, rotary_dim=64)
    elif form == "pos_ids":
        out = fi.apply_rope_pos_ids(q, k, pos, interleave=True)
        fi.apply_rope_pos_ids_inplace(qi, ki, pos, interleave=True)
    elif form == "llama31":
        out = fi.apply_llama31_rope(q, k, indptr, offsets)
        fi.apply_llama31_rope_inplace(qi, ki, indptr, offsets)
    else:
        out = fi.apply_rope_with_cos_sin_cache(pos, q.flatten(1), k.flatten(1), 128, cache)
        out = tuple(o.view(x.shape) for o, x in zip(out, (q, k)))
        fi.apply_rope_with_cos_sin_cache_inplace(pos, qi.flatten(1), ki.flatten(1), 128, cache)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # out of place leaves its inputs alone
    assert torch.equal(out[0], qi) and torch.equal(out[1], ki)


def test_interleaved_cache_on_its_last_row():
    """The last cache row, interleaved: the port reads only the half of each cos/sin vector it
    uses (the original reads past the row there); values against the oracle."""
    rows = 33
    ang = angles(torch.arange(rows), inv_freq(128))
    cache = torch.cat([torch.cos(ang), torch.sin(ang)], -1).float().cuda()
    q, k = _qk(4, hq=2, hk=1)
    pos = torch.full((4,), rows - 1, device="cuda")
    with _alloc.poisoned():
        q_out, k_out = fi.apply_rope_with_cos_sin_cache(pos, q, k, 128, cache, is_neox=False)
    _check(q_out, q, inv_freq(128), pos, "interleaved", 128, fast_math=False)
    _check(k_out, k, inv_freq(128), pos, "interleaved", 128, fast_math=False)


def test_strided_q_k_from_packed_qkv():
    """q and k cut from a packed qkv: token stride (Hq + 2 Hk) * D, head stride D."""
    hq, hk, d = 8, 2, 128
    qkv = torch.randn(50, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : hq * d].view(50, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(50, hk, d)
    pos = torch.randint(0, 2048, (50,), device="cuda")
    with _alloc.poisoned():
        q_out, k_out = fi.apply_rope_pos_ids(q, k, pos, rotary_dim=64)
    _check(q_out, q, inv_freq(64), pos, "rotate_half", 64)
    _check(k_out, k, inv_freq(64), pos, "rotate_half", 64)


# ---- against the installed library --------------------------------------------------------------
def _flashinfer():
    try:
        import flashinfer.rope as lib
    except Exception as exc:  # not installed on the project's GPU machine (wheel size)
        pytest.skip(f"flashinfer is not importable here ({exc.__class__.__name__}: {exc}); the "
                    "bit-for-bit comparison needs pip install flashinfer-python")
    return lib


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("fn", ["apply_rope_pos_ids", "apply_llama31_rope_pos_ids",
                                "apply_rope", "apply_rope_with_cos_sin_cache"])
def test_bit_for_bit_against_flashinfer(fn, interleave):
    """Same kernels, same compile mode (fast math), same launch parameters: equal bits. The
    strategy may differ only if the two builds' occupancy differs; both kernels agree bit for
    bit (test_both_strategies_agree_bit_for_bit), so the outputs must too."""
    lib = _flashinfer()
    q, k = _qk(200, hq=32, hk=8)
    pos = torch.randint(0, 8192, (200,), device="cuda", dtype=torch.int32)
    if fn == "apply_rope":
        args = (q, k, torch.tensor([0, 77, 200], device="cuda", dtype=torch.int32),
                torch.tensor([3, 4000], device="cuda", dtype=torch.int32))
        kw = dict(interleave=interleave)
    elif fn == "apply_rope_with_cos_sin_cache":
        ang = angles(torch.arange(8192), inv_freq(128))
        cache = torch.cat([torch.cos(ang), torch.sin(ang)], -1).float().cuda()
        args, kw = (pos, q.flatten(1), k.flatten(1), 128, cache), dict(is_neox=not interleave)
    else:
        args, kw = (q, k, pos), dict(interleave=interleave)
    want = getattr(lib, fn)(*args, **kw)
    got = getattr(fi, fn)(*args, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cache_positions_under_cuda_graph_capture():
    """The host cannot read positions while a graph is captured: the kernel bounds the cache row
    instead (valid positions as before; one past the cache gives that token NaN, no stray read)."""
    rows = 64
    ang = angles(torch.arange(rows), inv_freq(128))
    cache = torch.cat([torch.cos(ang), torch.sin(ang)], -1).float().cuda()
    q, k = _qk(8, hq=4, hk=2)
    pos = torch.arange(8, device="cuda") * 7
    fn = lambda: fi.apply_rope_with_cos_sin_cache(pos, q, k, 128, cache)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs' writes first
    with torch.cuda.stream(stream):
        fn()  # warm-up (compiles) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            q_out, k_out = fn()
    graph.replay()
    torch.cuda.synchronize()
    _check(q_out, q, inv_freq(128), pos.cpu(), "rotate_half", 128, fast_math=False)
    pos[-1] = rows  # one past the cache
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(q_out[-1]).all() and torch.isnan(k_out[-1]).all()
    assert not torch.isnan(q_out[:-1]).any()


def test_indptr_under_cuda_graph_capture():
    """The host cannot read indptr while a graph is captured: the kernel skips a segment whose
    bounds fall outside [0, nnz] (valid segments as before; a bad one stays poisoned, no stray
    access)."""
    q, k = _qk(8, hq=4, hk=2)
    indptr = torch.tensor([0, 3, 8], device="cuda")
    offsets = torch.tensor([0, 100], device="cuda")
    fi.apply_rope(q, k, indptr, offsets)  # warm-up (compiles) outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs' writes first
    with torch.cuda.stream(stream), _alloc.poisoned():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            q_out, k_out = fi.apply_rope(q, k, indptr, offsets)
    graph.replay()
    torch.cuda.synchronize()
    pos = torch.tensor([0, 1, 2, 100, 101, 102, 103, 104])
    _check(q_out, q, inv_freq(128), pos, "rotate_half", 128)
    indptr[2] = 9  # past nnz: the second segment is skipped
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(q_out[3:]).all() and torch.isnan(k_out[3:]).all()
    assert not torch.isnan(q_out[:3]).any()


def test_skipped_host_checks_leave_the_kernel_bounds():
    """``check_positions_on_host=False`` / ``check_indptr_on_host=False`` (the original's work, no
    sync): a position past the cache gives its token NaN, a segment past nnz stays unwritten
    (poisoned); the other tokens are rotated as with the checks."""
    rows = 64
    ang = angles(torch.arange(rows), inv_freq(128))
    cache = torch.cat([torch.cos(ang), torch.sin(ang)], -1).float().cuda()
    q, k = _qk(8, hq=4, hk=2)
    pos = torch.arange(8, device="cuda") * 7
    pos[-1] = rows  # one past the cache
    with pytest.raises(ValueError, match="positions span"):
        fi.apply_rope_with_cos_sin_cache(pos, q, k, 128, cache)
    q_out, k_out = fi.apply_rope_with_cos_sin_cache(pos, q, k, 128, cache,
                                                    check_positions_on_host=False)
    torch.cuda.synchronize()
    assert torch.isnan(q_out[-1]).all() and torch.isnan(k_out[-1]).all()
    _check(q_out[:-1], q[:-1], inv_freq(128), pos[:-1].cpu(), "rotate_half", 128,
           fast_math=False)
    indptr = torch.tensor([0, 3, 9], device="cuda")  # the second segment ends past nnz = 8
    offsets = torch.tensor([0, 100], device="cuda")
    with pytest.raises(ValueError, match="must rise within"):
        fi.apply_rope(q, k, indptr, offsets)
    with _alloc.poisoned():
        q_out, k_out = fi.apply_rope(q, k, indptr, offsets, check_indptr_on_host=False)
    torch.cuda.synchronize()
    assert torch.isnan(q_out[3:]).all() and torch.isnan(k_out[3:]).all()
    _check(q_out[:3], q[:3], inv_freq(128), torch.arange(3), "rotate_half", 128)


def test_offsets_more_than_2_31():
    """q of 2^31 + 32 * 128 elements (524289 tokens x 32 heads x 128, bf16, 4.3 GB), rotated in
    place: the last token's offset is past int32, which size_t strides hold. The last tokens are
    checked against the oracle, and the first, so a wrapped offset would show."""
    nnz, hq, d = 2**31 // (32 * 128) + 1, 32, 128
    q = torch.randn(nnz, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(nnz, 1, d, device="cuda", dtype=torch.bfloat16)
    assert q.numel() > 2**31
    pos = torch.arange(nnz, device="cuda") % 4096
    picks = torch.tensor([0, 1, nnz - 2, nnz - 1])
    before_q, before_k = q[picks.cuda()].clone(), k[picks.cuda()].clone()
    fi.apply_rope_pos_ids_inplace(q, k, pos)
    _check(q[picks.cuda()], before_q, inv_freq(128), pos[picks.cuda()].cpu(), "rotate_half", 128)
    _check(k[picks.cuda()], before_k, inv_freq(128), pos[picks.cuda()].cpu(), "rotate_half", 128)
