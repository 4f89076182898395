"""The peers' adapters on the CPU, against stand-in modules with each library's signature.

Each stand-in implements the library's documented semantics (what its tables, positions and
flags mean) in plain torch and is put into ``sys.modules`` where the adapter imports the library
from, so the adapter's mapping of the canonical case to that API is validated against the float64
oracle by the real harness (``run_case``), inputs-unchanged check included. The bug classes the
peers' users hit are cases here: convention names that mean the opposite of what they seem, a
partial rotary dim, per-sequence offsets and per-token ids, in-place libraries that must not
touch the study's inputs, GQA k with fewer heads, strided q cut from a packed qkv.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch

from ports import registry
from ports.harness.runner import run_case
from ports.peers import NotInstalled, canonical, flash_attn_rotary
from reference.case import RopeCase

CPU = torch.device("cpu")


# ---- the stand-ins' shared math: x rotated by per-token full-width tables -------------------
def _rotate(x, cos, sin, interleaved: bool):
    """x [..., d] by cos/sin [..., R] (broadcast), pairs by the convention; tail passes."""
    r = cos.shape[-1]
    rot, rest = x[..., :r].float(), x[..., r:]
    if interleaved:
        pair = torch.stack([-rot[..., 1::2], rot[..., 0::2]], dim=-1).flatten(-2)
    else:
        a, b = rot.chunk(2, dim=-1)
        pair = torch.cat([-b, a], dim=-1)
    y = rot * cos.float() + pair * sin.float()
    return torch.cat([y.to(x.dtype), rest], dim=-1)


def _full(half, interleaved: bool):
    return half.repeat_interleave(2, -1) if interleaved else torch.cat([half, half], -1)


def _theta_tables(pos, rotary_dim, theta):
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = pos.to(torch.float64)[..., None] * inv
    return torch.cos(ang), torch.sin(ang)


# ---- stand-in modules --------------------------------------------------------------------------
def _fake_liger():
    class LigerRopeFunction:
        @staticmethod
        def apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
            # q, k: HF [b, h, s, d] views; rotated in place in their bshd storage when that is
            # contiguous (as Liger does); cos [s, R] or [b, s, R], only the first half read.
            outs = []
            for t in (q, k):
                bshd = t.transpose(1, 2).contiguous()
                c = cos if cos.dim() == 3 else cos[None]
                s_ = sin if sin.dim() == 3 else sin[None]
                half = c.shape[-1] // 2
                bshd.copy_(_rotate(bshd, _full(c[..., :half], False)[:, :, None],
                                   _full(s_[..., :half], False)[:, :, None], False))
                outs.append(bshd.transpose(1, 2))
            return tuple(outs)

    mod = types.ModuleType("liger_kernel.ops.rope")
    mod.LigerRopeFunction = LigerRopeFunction
    return {"liger_kernel": types.ModuleType("liger_kernel"),
            "liger_kernel.ops": types.ModuleType("liger_kernel.ops"), "liger_kernel.ops.rope": mod}


def _fake_vllm():
    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
        assert positions.dtype == torch.int64 and cos_sin_cache.dtype == query.dtype
        rot = cos_sin_cache.shape[1]
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, R/2] each
        for t in (query, key):
            if t is None:
                continue
            v = t.view(t.shape[0], -1, head_size)
            v.copy_(_rotate(v, _full(cos, not is_neox)[:, None, :rot],
                            _full(sin, not is_neox)[:, None, :rot], not is_neox))

    mod = types.ModuleType("vllm._custom_ops")
    mod.rotary_embedding = rotary_embedding
    return {"vllm": types.ModuleType("vllm"), "vllm._custom_ops": mod}


def _fake_te():
    def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None,
                             interleaved=False, fused=False, cu_seqlens=None, cp_size=1,
                             cp_rank=0):
        assert freqs.dtype == torch.float32 and freqs.dim() == 4 and fused
        f = freqs[:, 0, 0, :].double()  # [L, R] angles in the convention's layout
        if tensor_format == "thd":
            lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            pos = torch.cat([torch.arange(n) for n in lens])
            ang = f[pos][:, None]
        else:
            x_bshd = t if tensor_format == "bshd" else t.transpose(0, 1)
            b, s = x_bshd.shape[:2]
            start = (torch.zeros(b, dtype=torch.int64) if start_positions is None
                     else start_positions.long())
            pos = start[:, None] + torch.arange(s)[None]
            ang = f[pos][:, :, None]
            if tensor_format == "sbhd":
                ang = ang.transpose(0, 1)
        return _rotate(t, torch.cos(ang), torch.sin(ang), interleaved)

    mod = types.ModuleType("transformer_engine.pytorch.attention.rope")
    mod.apply_rotary_pos_emb = apply_rotary_pos_emb
    names = ("transformer_engine", "transformer_engine.pytorch",
             "transformer_engine.pytorch.attention")
    return {**{n: types.ModuleType(n) for n in names}, mod.__name__: mod}


def _fake_flashinfer():
    def _apply(q, k, pos, rotary_dim, interleave, theta, out=None):
        cos, sin = _theta_tables(pos, rotary_dim, theta)
        cos, sin = _full(cos, interleave)[:, None], _full(sin, interleave)[:, None]
        outs = [_rotate(t, cos, sin, interleave) for t in (q, k)]
        if out is None:
            return tuple(outs)
        for t, o in zip(out, outs):
            t.copy_(o)

    def _pos_from_indptr(indptr, offsets):
        return torch.cat([torch.arange(int(indptr[i + 1] - indptr[i])) + int(offsets[i])
                          for i in range(len(offsets))])

    def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1,
                   rope_theta=1e4):
        return _apply(q, k, _pos_from_indptr(indptr, offsets), rotary_dim or q.shape[-1],
                      interleave, rope_theta)

    def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False,
                           rope_scale=1, rope_theta=1e4):
        _apply(q, k, _pos_from_indptr(indptr, offsets), rotary_dim or q.shape[-1], interleave,
               rope_theta, out=(q, k))

    def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1,
                           rope_theta=1e4):
        return _apply(q, k, pos_ids, rotary_dim or q.shape[-1], interleave, rope_theta)

    def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False,
                                   rope_scale=1, rope_theta=1e4):
        _apply(q, k, pos_ids, rotary_dim or q.shape[-1], interleave, rope_theta, out=(q, k))

    def _cache(positions, query, key, head_size, cos_sin_cache, is_neox):
        assert cos_sin_cache.dtype == torch.float32
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
        outs = []
        for t in (query, key):
            v = t.view(t.shape[0], -1, head_size)
            outs.append(_rotate(v, _full(cos, not is_neox)[:, None], _full(sin, not is_neox)[
                :, None], not is_neox).reshape(t.shape))
        return outs

    def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache,
                                      is_neox=True):
        return tuple(_cache(positions, query, key, head_size, cos_sin_cache, is_neox))

    def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                              is_neox=True):
        for t, o in zip((query, key), _cache(positions, query, key, head_size, cos_sin_cache,
                                              is_neox)):
            t.copy_(o)

    mod = types.ModuleType("flashinfer.rope")
    for fn in (apply_rope, apply_rope_inplace, apply_rope_pos_ids, apply_rope_pos_ids_inplace,
               apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace):
        setattr(mod, fn.__name__, fn)
    return {"flashinfer": types.ModuleType("flashinfer"), "flashinfer.rope": mod}


FLASH_ATTN_STAND_IN = '''
import torch

def apply_rotary(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None,
                 interleaved=False, inplace=False, conjugate=False):
    assert cos.shape[-1] * 2 <= x.shape[-1] <= 256
    full = (lambda h: h.repeat_interleave(2, -1)) if interleaved else (
        lambda h: torch.cat([h, h], -1))
    if cu_seqlens is not None:
        pos = torch.cat([torch.arange(int(cu_seqlens[i + 1] - cu_seqlens[i]))
                         for i in range(len(cu_seqlens) - 1)])
        c, s = full(cos[pos])[:, None], full(sin[pos])[:, None]
    else:
        b, n = x.shape[:2]
        off = (seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor)
               else torch.full((b,), seqlen_offsets))
        pos = off[:, None].long() + torch.arange(n)[None]
        c, s = full(cos[pos])[:, :, None], full(sin[pos])[:, :, None]
    r = c.shape[-1]
    rot = x[..., :r].float()
    if interleaved:
        pair = torch.stack([-rot[..., 1::2], rot[..., 0::2]], -1).flatten(-2)
    else:
        a, bb = rot.chunk(2, -1)
        pair = torch.cat([-bb, a], -1)
    y = torch.cat([(rot * c.float() + pair * s.float()).to(x.dtype), x[..., r:]], -1)
    if inplace:
        x.copy_(y)
        return x
    return y
'''


@pytest.fixture
def installed(monkeypatch, tmp_path):
    """Every peer's stand-in importable; flash-attn's from a file named by the env variable."""
    for fake in (_fake_liger(), _fake_vllm(), _fake_te(), _fake_flashinfer()):
        for name, mod in fake.items():
            monkeypatch.setitem(sys.modules, name, mod)
    path = tmp_path / "rotary.py"
    path.write_text(FLASH_ATTN_STAND_IN)
    monkeypatch.setenv("ROPE_PORTS_FLASH_ATTN_ROTARY", str(path))
    monkeypatch.delitem(sys.modules, "_rope_ports_flash_attn_rotary", raising=False)
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    canonical._available.cache_clear()
    yield
    canonical._available.cache_clear()
    sys.modules.pop("_rope_ports_flash_attn_rotary", None)


def _on_cpu(spec):
    return dataclasses.replace(spec, devices=frozenset({"cpu"}))


PEERS = [s.name for s in registry.REGISTRY if s.kind == "peer"]

CASES = [
    RopeCase(2, 12, 4, 32, dtype="bf16", kv_heads=2, label="gqa bf16"),
    RopeCase(2, 12, 4, 32, dtype="fp16", kv_heads=2, style="interleaved", label="gpt-j pairs"),
    RopeCase(2, 12, 4, 32, dtype="bf16", kv_heads=2, rotary_dim=16, positions="offset",
             max_position=64, label="partial rotary, per-sequence offsets"),
    RopeCase(2, 12, 4, 32, dtype="bf16", kv_heads=1, positions="ids", label="per-token ids"),
    RopeCase(2, 12, 4, 32, dtype="fp32", kv_heads=2, label="fp32"),
    RopeCase(3, 10, 4, 32, dtype="bf16", kv_heads=2, layout="thd", seqlens=(10, 1, 7),
             label="thd"),
    RopeCase(2, 12, 4, 32, dtype="bf16", kv_heads=2, layout="sbhd", label="sbhd"),
    RopeCase(2, 12, 4, 32, dtype="bf16", kv_heads=2, contiguous=False, label="q of packed qkv"),
    RopeCase(2, 12, 4, 32, dtype="bf16", kv_heads=2, direction="backward", label="backward"),
]


def _cos_sin_variants(case):
    return [case, case.replace(cos_sin_dtype="same")]


@pytest.mark.parametrize("case", [v for c in CASES for v in _cos_sin_variants(c)],
                         ids=lambda c: f"{c.label}/{c.cos_sin_dtype}")
def test_every_peer_adapter_matches_the_oracle_through_its_stand_in(installed, case):
    specs = [_on_cpu(registry.get(n)) for n in PEERS]
    rep = run_case(case, specs, targets=frozenset({"cpu"}), device=CPU, timing_on=False)
    ran = [r for r in rep.results if r.status != "unsupported"]
    assert ran, [r.reason for r in rep.results]
    bad = [(r.impl, r.status, r.reason) for r in ran if r.status != "ok"]
    assert not bad
    for r in rep.results:
        assert "not installed" not in r.reason


def test_each_peer_runs_somewhere_in_the_cases(installed):
    ran = set()
    for case in (v for c in CASES for v in _cos_sin_variants(c)):
        specs = [_on_cpu(registry.get(n)) for n in PEERS]
        rep = run_case(case, specs, targets=frozenset({"cpu"}), device=CPU, timing_on=False)
        ran |= {r.impl for r in rep.results if r.status == "ok"}
    assert ran == set(PEERS)


def test_a_broken_stand_in_fails_validation(installed, monkeypatch):
    """The check can fail: a vLLM that reads the convention flag backwards is caught."""
    real = sys.modules["vllm._custom_ops"].rotary_embedding
    monkeypatch.setattr(sys.modules["vllm._custom_ops"], "rotary_embedding",
                        lambda p, q, k, h, c, neox: real(p, q, k, h, c, not neox))
    spec = _on_cpu(registry.get("vllm.rotary_embedding"))
    case = RopeCase(2, 12, 4, 32, dtype="bf16", kv_heads=2, cos_sin_dtype="same")
    rep = run_case(case, [spec], targets=frozenset({"cpu"}), device=CPU, timing_on=False)
    assert rep.results[0].status == "FAIL"


def test_an_in_place_peer_that_wrote_the_inputs_would_fail(installed, monkeypatch):
    """In-place peers run on copies; an adapter that handed them the inputs is caught."""
    monkeypatch.setattr(canonical, "_in_place_call",
                        lambda case, inputs, rotate: lambda: tuple(rotate(list(inputs.xs))))
    spec = _on_cpu(dataclasses.replace(registry.get("vllm.rotary_embedding"),
                                       prepare=canonical._prepare_vllm))
    case = RopeCase(2, 12, 4, 32, dtype="bf16", kv_heads=2, cos_sin_dtype="same")
    rep = run_case(case, [spec], targets=frozenset({"cpu"}), device=CPU, timing_on=False)
    assert rep.results[0].status == "FAIL" and "modified its input" in rep.results[0].reason


def test_not_installed_rows_say_how_to_install(monkeypatch):
    for name in ("liger_kernel", "liger_kernel.ops", "liger_kernel.ops.rope", "vllm",
                 "vllm._custom_ops"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    canonical._available.cache_clear()
    try:
        case = RopeCase(2, 12, 4, 32, dtype="bf16", kv_heads=2, cos_sin_dtype="same")
        specs = [_on_cpu(registry.get(n)) for n in ("liger.rope", "vllm.rotary_embedding")]
        rep = run_case(case, specs, targets=frozenset({"cpu"}), device=CPU, timing_on=False)
        liger, vllm = (r.reason for r in rep.results)
        assert liger.startswith("not installed: pip install liger-kernel")
        assert vllm.startswith("not installed: pip install vllm")
        assert all(r.status == "unsupported" for r in rep.results)
        # A design limit is named before the missing library.
        rep = run_case(case.replace(kv_heads=None), specs[:1], targets=frozenset({"cpu"}),
                       device=CPU, timing_on=False)
        assert "needs a k" in rep.results[0].reason
    finally:
        canonical._available.cache_clear()


def test_flash_attn_without_its_package_or_file_says_why(monkeypatch):
    monkeypatch.delenv("ROPE_PORTS_FLASH_ATTN_ROTARY", raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.delitem(sys.modules, "_rope_ports_flash_attn_rotary", raising=False)
    with pytest.raises(NotInstalled, match="pip install flash-attn"):
        flash_attn_rotary()


def test_equal_inputs_notes_reach_the_tables_and_the_summary(installed):
    from ports.harness import report

    case = RopeCase(2, 12, 4, 32, dtype="bf16", kv_heads=2, positions="ids",
                    cos_sin_dtype="same")
    specs = [_on_cpu(registry.get("liger.rope")), _on_cpu(registry.get("torch.hf_rotate_half"))]
    rep = run_case(case, specs, targets=frozenset({"cpu"}), device=CPU, timing_on=False)
    note = "note: liger.rope is given less work: cos/sin rows gathered per token"
    assert note in report.case_table(rep)
    assert note in report.case_table(rep, verbose=True)
    rows = report.flat_rows([rep], {"gpu": "test"})
    for r, t in zip(rows, (3.0, 1.5)):
        r["median_us"] = t
    assert note in report.summary_table(rows, "median_us")


def test_vs_fastest_is_each_time_over_the_cases_fastest():
    from ports.harness import metrics
    from ports.harness.result import Result

    results = [Result("a", "f", "port", "ok", median_us=4.0, graph_us=2.0),
               Result("b", "f", "peer", "ok", median_us=2.0, graph_us=3.0),
               Result("c", "f", "port", "unsupported")]
    metrics.derive(results, io_bytes=1000)
    assert [r.vs_fastest for r in results] == [2.0, 1.0, None]
    assert [r.graph_vs_fastest for r in results] == [1.0, 1.5, None]
    assert "vs_fastest" in metrics.SUMMARY_VALUES


def test_peers_suite_is_equal_inputs_prefill_and_decode_with_gqa():
    from ports.harness.suites import GRAPH_SUITES, get_suite

    cases = get_suite("peers")
    assert {c.dtype for c in cases} == {"bf16", "fp32"}
    assert all(c.kv_heads and c.kv_heads < c.heads for c in cases)
    assert {c.seqlen == 1 for c in cases} == {True, False}
    assert "peers" in GRAPH_SUITES


def test_liger_for_real_under_the_triton_interpreter():
    """With liger-kernel installed, its real Triton kernel (interpreted) through the adapter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is off (a GPU is present): tests/test_gpu_peers.py "
                    "runs Liger on the GPU")
    pytest.importorskip("liger_kernel.ops.rope")
    canonical._available.cache_clear()
    spec = dataclasses.replace(registry.get("liger.rope"), devices=frozenset({"interpret"}))
    for case in (RopeCase(2, 8, 4, 32, kv_heads=2),
                 RopeCase(2, 8, 4, 32, kv_heads=2, positions="ids", rotary_dim=16)):
        rep = run_case(case, [spec], targets=frozenset({"interpret"}), device=CPU,
                       timing_on=False)
        assert rep.results[0].status == "ok", rep.results[0].reason

