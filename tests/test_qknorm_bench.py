"""The qknorm suite's host side without a GPU: the table and data file it writes, the check's
ulp measure, the CLI's refusals, and the packed-qkv inputs of the vLLM row proven to compute the
oracle's answer (the op's float64 semantics on them: tests/_vllm_reference.py's rotation after
the float64 RMSNorm)."""
from __future__ import annotations

import json

import pytest
import torch

from _vllm_reference import rotate_tokens
from ports.harness import qknorm_bench as bench
from reference.qk_norm import qk_norm_rope_oracle, rms_norm
from reference.tables import rope_tables

ROWS = [dict(shape="s", direction="forward", impl="copy", input="", us=10.0, copy_us=10.0),
        dict(shape="s", direction="forward", impl="fastrope fused", input=bench.Q_K, us=12.5,
             copy_us=10.0, err_ulp=0.5),
        dict(shape="s", direction="forward", impl="rms_norm + fastrope", input=bench.Q_K,
             us=25.0, copy_us=10.0),
        dict(shape="s", direction="forward", impl="compiled unfused", input=bench.Q_K, us=None,
             copy_us=10.0, reason="RuntimeError: boom"),
        dict(shape="s", direction="backward", impl="vllm_port fused (fwd only)",
             input=bench.PACKED, us=None, copy_us=15.0,
             reason="unsupported: forward only (as upstream)")]


def test_table_cells():
    lines = bench.table(ROWS).splitlines()
    assert lines[0] == ("| shape | direction | implementation | input | us | % copy | x unfused "
                        "| err (ulp) |")
    assert lines[2] == "| s | forward | copy |  | 10.0 | 100% | 2.50 |  |"
    assert lines[3] == f"| s | forward | fastrope fused | {bench.Q_K} | 12.5 | 80% | 2.00 | 0.50 |"
    assert lines[4] == f"| s | forward | rms_norm + fastrope | {bench.Q_K} | 25.0 | 40% | 1.00 |  |"
    assert "RuntimeError: boom" in lines[5]
    assert "packed qkv" in lines[6] and "forward only" in lines[6]


def test_data_file_keeps_other_shapes_of_the_same_dtype():
    first = bench.data_file(ROWS, dtype="bf16", command="cmd a")
    assert first["columns"] == bench.COLUMNS and len(first["rows"]) == len(ROWS)
    assert first["rows"][1][4] == "12.5" and first["gpu"] and first["commit"]
    json.dumps(first)  # serialisable
    other = [dict(r, shape="t") for r in ROWS[:2]]
    merged = bench.data_file(other, dtype="bf16", command="cmd b", previous=first)
    assert len(merged["measurements"]) == len(ROWS) + 2
    assert merged["command"] == ["cmd a", "cmd b"]
    fresh = bench.data_file(other, dtype="fp16", command="cmd b", previous=first)
    assert bench.data_file(other, dtype="fp16", command="c", commit="abc1234")["commit"] \
        == "abc1234"
    assert len(fresh["measurements"]) == 2  # another dtype starts over


def test_ulps_off():
    ref = torch.tensor([1.0, -1.5], dtype=torch.float64)
    assert bench.ulps_off(ref + 2 ** -7, ref, torch.bfloat16) == pytest.approx(1.0)
    assert bench.ulps_off(ref, ref, torch.bfloat16) == 0.0
    assert bench.ulps_off(torch.tensor([float("nan"), 1.0]), ref, torch.bfloat16) == float("inf")


def test_cli_refusals(capsys, tmp_path):
    assert bench.main(["--set", "WARPS=8"]) == 2
    assert "--set takes NAME=INT" in capsys.readouterr().err
    assert bench.main(["--shapes", "no such shape"]) == 2
    assert "no shape named" in capsys.readouterr().err
    bad = tmp_path / "x.json"
    bad.write_text("not json")
    assert bench.main(["--json", str(bad)]) == 2
    assert "is not JSON" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_every_shape_is_named_once():
    names = [s.name for s in bench.SHAPES]
    assert len(set(names)) == len(names)
    assert max(s.b * s.s for s in bench.SHAPES) == 32768


def test_packed_inputs_give_the_oracles_answer():
    """The vLLM row's packed qkv, cat(cos, sin) cache and per-token positions, put through the
    op's semantics in float64 (per-head RMSNorm, then the cache's rotation), equal the oracle on
    the q and k every other row gets; v's columns are outside q's and k's."""
    shape = bench.Shape("t", 2, 5, 4, 2, 16)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 5, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 5, 2, 16, generator=gen, dtype=torch.float64)
    qw = torch.randn(16, generator=gen, dtype=torch.float64)
    cos, sin = rope_tables(5, 16, dtype=torch.float64)
    qkv = bench.packed_qkv(q, k, v)
    assert qkv.shape == (10, (4 + 2 + 2) * 16) and qkv.is_contiguous()
    uq, uk = bench.unpack_qk(qkv, shape)
    assert torch.equal(uq, q) and torch.equal(uk, k)
    assert torch.equal(qkv[:, 6 * 16:].reshape(2, 5, 2, 16), v)
    cache = bench.cat_cos_sin_cache(cos, sin)
    pos = torch.arange(5).repeat(2)
    got = rotate_tokens(rms_norm(uq.reshape(10, 4, 16), qw, bench.EPS), pos, cache,
                        is_neox=True)
    want = qk_norm_rope_oracle(q, qw, bench.EPS, cos, sin, torch.arange(5).expand(2, 5),
                               layout="bshd", style="rotate_half")
    torch.testing.assert_close(got, want.reshape(10, 4, 16), rtol=1e-12, atol=1e-12)


def test_rows_and_their_refusals():
    shape = bench.SHAPES[2]
    rows = {r.name: r for r in bench._rows(shape)}
    vllm = rows["vllm_port fused (fwd only)"]
    fi = rows["flashinfer_port token-norm (fwd only)"]
    assert not vllm.backward and not fi.backward and rows["fastrope fused"].backward
    assert vllm.input == bench.PACKED and fi.input == bench.PACKED_OUT and fi.norm == "token"
    assert vllm.refuses(shape, torch.float16) is None
    assert fi.refuses(shape, torch.bfloat16) is None
    assert fi.refuses(shape, torch.float16) == "bf16 only"
    gemma = next(s for s in bench.SHAPES if s.gemma)
    assert "1 + w" in vllm.refuses(gemma, torch.bfloat16)
    assert {"compiled unfused", "hf eager", "rms_norm + fastrope"} <= set(rows)
    assert rows["compiled unfused token-norm"].norm == "token"


def test_fastrope_rows_get_half_width_tables(monkeypatch):
    """fastrope's rows call it with the first halves of the full-width tables (``[L, R/2]``, the
    angles vLLM's cache holds), made before the timed call; the input column says so."""
    import ports.fastrope
    import ports.fastrope.qknorm

    seen = []

    def record(q, k, *args, cos, sin, **kw):
        seen.append((cos.clone(), sin.clone()))
        return q, k

    monkeypatch.setattr(ports.fastrope.qknorm, "qk_norm_rope", record)
    monkeypatch.setattr(ports.fastrope, "apply_rope", record)
    shape = bench.Shape("t", 1, 3, 2, 2, 8)
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    w = torch.ones(8)
    cos, sin = rope_tables(3, 8)
    rows = {r.name: r for r in bench._rows(shape)}
    names = ["fastrope fused", "fastrope fused token-norm", "rms_norm + fastrope",
             "hf eager + fastrope"]
    want_cos, want_sin = cos[:, :4].clone(), sin[:, :4].clone()
    for name in names:
        assert rows[name].input.endswith(bench.HALF_TABLES), name
        run = rows[name].prepare(q, k, w, w, cos, sin)
        cos.fill_(float("nan"))  # the halves were made before the timed call: the run sees none
        run()
        cos[:, :4], cos[:, 4:] = want_cos, want_cos
        got_cos, got_sin = seen.pop()
        assert got_cos.shape == (3, 4) and torch.equal(got_cos, want_cos), name
        assert torch.equal(got_sin, want_sin), name
    assert rows["compiled unfused"].input == bench.Q_K


def test_token_norm_oracle_over_all_heads():
    """The token-norm rows are checked against the norm over all heads, with ``[heads * d]``
    weights (the per-head weight tiled): with equal heads that is the per-head norm (the mean
    over heads equals each one's)."""
    shape = bench.Shape("t", 1, 3, 2, 2, 8)
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(1, 3, 1, 8, generator=gen, dtype=torch.float64)
    q = head.expand(1, 3, 2, 8).contiguous()
    w = torch.randn(8, generator=gen, dtype=torch.float64)
    cos, sin = rope_tables(3, 8, dtype=torch.float64)
    per_head = bench.oracle(shape, (q, q.clone(), w, w, cos, sin), "forward")
    tiled = w.repeat(2)
    token = bench.oracle(shape, (q, q.clone(), tiled, tiled, cos, sin), "forward", norm="token")
    torch.testing.assert_close(token[0], per_head[0], rtol=1e-12, atol=1e-12)


def test_unfused_token_norm_is_the_token_oracle():
    """The compiled token-norm row's function (its norm in float32, as transformers computes it)
    on float64 inputs: the norm over all of a token's heads with ``[heads * d]`` weights, then
    RoPE; the oracle's answer to float32's rounding, and not the per-head norm's."""
    shape = bench.Shape("t", 2, 3, 2, 2, 8)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 2, 8, generator=gen, dtype=torch.float64) * (1 + torch.arange(2.0))
            .view(1, 1, 2, 1) for _ in range(2))  # heads of different scales
    qw, kw = (torch.randn(16, generator=gen, dtype=torch.float64) for _ in range(2))
    cos, sin = rope_tables(3, 8, dtype=torch.float64)
    got = bench.unfused_token(q, k, qw, kw, cos, sin, False)
    want = bench.oracle(shape, (q, k, qw, kw, cos, sin), "forward", norm="token")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    w = qw[:8]  # the same weight on both heads: the norms alone tell the two apart
    tiled = bench.unfused_token(q, k, w.repeat(2), w.repeat(2), cos, sin, False)
    per_head = bench.unfused(q, k, w, w, cos, sin, False)
    assert not torch.allclose(per_head[0], tiled[0], rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_measure_times_every_row_in_interleaved_rounds(monkeypatch):
    """One small shape, both directions: every row the oracle passes gets a time (a backward's
    from its backward alone, captured on its forward's stream), every call is timed ROUNDS
    times, the copy rows come first, and a row whose timing fails once gets the reason while
    the others keep theirs."""
    from ports.harness import timing

    monkeypatch.setattr(bench, "ROUNDS", 2)
    timed = []  # keeps every timed call alive, so their ids stay distinct
    real = timing.graph_median_us

    def backward(fn):
        return getattr(fn, "capture_stream", None) is not None

    def counting(fn, *, rep_ms):
        timed.append(fn)
        if backward(fn) and sum(map(backward, timed)) == 1:
            raise RuntimeError("capture failed")  # the first backward's first round
        return real(fn, rep_ms=rep_ms)

    monkeypatch.setattr(timing, "graph_median_us", counting)
    rows = bench.measure(bench.Shape("tiny", 2, 64, 4, 2, 64), torch.bfloat16, rep_ms=5,
                         check=True)
    for direction in ("forward", "backward"):
        assert [r["impl"] for r in rows if r["direction"] == direction][0] == "copy"
    fused = next(r for r in rows if r["impl"] == "fastrope fused" and r["direction"] == "forward")
    assert fused["err_ulp"] <= 1 and 0 < fused["us"] < 1e6 and fused["copy_us"] > 0
    failed = [r for r in rows if r.get("reason") == "RuntimeError: capture failed"]
    assert len(failed) == 1 and failed[0]["direction"] == "backward" and failed[0]["us"] is None
    for r in rows:
        if r["us"] is None:
            assert r in failed or r["reason"].startswith("unsupported"), r
    assert sum(r["us"] is not None for r in rows) >= 8
    assert len(timed) == 2 * len(set(map(id, timed)))
    backward_rows = [r for r in rows if r["direction"] == "backward" and r["impl"] != "copy"
                     and (r["us"] is not None or r in failed)]
    assert len({id(f) for f in timed if backward(f)}) == len(backward_rows)
