"""A backward case's CUDA-graph time (``compare.py --graph``): its prepared call gives the backward
alone (``AutogradCall.backward_alone``: the forward run once, on the stream the backward is
captured on, since autograd runs a backward on its forward's stream), and the runner times that
call's replays. Runs on the CPU with the timers stubbed; tests/test_gpu_timing.py captures it."""
from __future__ import annotations

import pytest
import torch

from ports import registry
from ports._adapters import AutogradCall
from ports.harness import runner, timing
from reference.case import RopeCase, make_inputs

CASE = RopeCase(2, 16, 4, 32, direction="backward", kv_heads=2)


def test_the_backward_alone_gives_the_calls_gradients_again_and_again():
    spec = registry.get("torch.hf_rotate_half")
    fn = spec.prepare(CASE, make_inputs(CASE, seed=0))
    assert isinstance(fn, AutogradCall)
    backward = fn.backward_alone()
    assert backward.capture_stream is None  # CPU tensors: no stream to capture on
    first, again, alone, alone_again = fn(), fn(), backward(), backward()
    assert len(first) == 2  # dq and dk
    for a, b, c, d in zip(first, again, alone, alone_again):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


def test_backward_graph_time_is_the_backward_alones(monkeypatch):
    timed = []

    def graph_median_us(fn, **kw):
        timed.append(fn)
        return 8.0

    monkeypatch.setattr(timing, "graph_median_us", graph_median_us)
    monkeypatch.setattr(timing, "median_us", lambda fn, **kw: 30.0)
    monkeypatch.setattr(timing, "copy_us", lambda nbytes, index=0, graph=False: 2.0)
    monkeypatch.setattr(timing, "copy_bandwidth_gbps", lambda index=0: 1000.0)
    spec = registry.get("torch.hf_rotate_half")
    report = runner.run_case(CASE, [spec], timing_on=True, graph=True,
                             device=torch.device("cpu"))
    (result,) = report.results
    assert result.status == "ok", result.reason
    assert result.median_us == 30.0 and result.graph_us == 8.0
    assert len(timed) == 1 and hasattr(timed[0], "capture_stream")
    assert timed[0].__name__ == "backward"
    plain = runner.run_case(CASE, [spec], timing_on=True, graph=False,
                            device=torch.device("cpu"))
    assert plain.results[0].graph_us is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fastrope.rope", "torch.compile(hf_rotate_half)"])
def test_a_graph_captured_on_the_capture_stream_holds_the_backward(name):
    """Captured on its ``capture_stream``, the backward alone's graph writes the gradients on
    every replay: its outputs, poisoned after the capture, hold the call's gradients again."""
    case = RopeCase(2, 256, 8, 64, dtype="bf16", direction="backward", kv_heads=2)
    fn = registry.get(name).prepare(case, make_inputs(case, seed=1, device=torch.device("cuda")))
    backward = fn.backward_alone()
    assert isinstance(backward.capture_stream, torch.cuda.Stream)
    want = fn()
    backward()  # warm up on the capture stream, as graph_median_us does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=backward.capture_stream):
        got = backward()
    for g in got:
        g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert 0 < timing.graph_median_us(backward, rep_ms=5) < 1e4


def test_a_row_whose_capture_fails_keeps_its_results_and_says_why(monkeypatch):
    """A call that cannot be captured (here every call, forward and backward) keeps its check
    and event time; its graph cell reads ``failed`` and the table says why, below."""
    from ports.harness import report

    def graph_median_us(fn, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(timing, "graph_median_us", graph_median_us)
    monkeypatch.setattr(timing, "median_us", lambda fn, **kw: 30.0)
    monkeypatch.setattr(timing, "copy_us", lambda nbytes, index=0, graph=False: 2.0)
    monkeypatch.setattr(timing, "copy_bandwidth_gbps", lambda index=0: 1000.0)
    spec = registry.get("torch.hf_rotate_half")
    for case in (CASE, RopeCase(2, 16, 4, 32, kv_heads=2)):
        rep = runner.run_case(case, [spec], timing_on=True, graph=True,
                              device=torch.device("cpu"))
        (result,) = rep.results
        assert result.status == "ok" and result.median_us == 30.0 and result.graph_us is None
        assert result.graph_note == ("no CUDA-graph time: RuntimeError: operation not "
                                     "permitted when stream is capturing")
        for verbose in (False, True):
            table = report.case_table(rep, graph=True, verbose=verbose)
            assert "| failed " in table
            assert f"{spec.name}: no CUDA-graph time: RuntimeError" in table


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_a_capture_that_fails_on_the_gpu_leaves_the_next_rows_their_graph_times(direction):
    """Your own kernel that syncs with the host (``.item()``) cannot be captured: its row keeps
    its check and event time and says why it has no graph time, and the rows after it are
    captured and replayed as usual."""
    from ports.peers.user import rope_impl, spec_from_callable

    @rope_impl(styles=["rotate_half"], layouts=["bshd"], backward=True, devices=["cuda"])
    def syncing(q, k, cos, sin, positions, *, style, layout, rotary_dim):
        c, s = (t[positions].unsqueeze(-2).float() for t in (cos, sin))

        def synced(g):
            g.float().sum().item()  # a host sync: illegal while a stream is capturing
            return g

        def rotate(x):
            x1, x2 = x.float().chunk(2, dim=-1)
            y = (torch.cat([x1, x2], -1) * c + torch.cat([-x2, x1], -1) * s).to(x.dtype)
            if y.requires_grad:  # the backward syncs too
                y.register_hook(synced)
            return y
        positions.max().item()
        return rotate(q), None if k is None else rotate(k)

    case = RopeCase(2, 128, 4, 64, dtype="bf16", direction=direction, kv_heads=2)
    specs = [spec_from_callable(syncing, "test:syncing"), registry.get("torch.hf_rotate_half")]
    rep = runner.run_case(case, specs, graph=True, device=torch.device("cuda"))
    by_name = {r.impl: r for r in rep.results}
    bad, after = by_name[specs[0].name], by_name["torch.hf_rotate_half"]
    assert bad.status == "ok" and bad.median_us > 0 and bad.graph_us is None
    assert bad.graph_note.startswith("no CUDA-graph time:")
    assert after.status == "ok" and after.graph_us is not None and after.graph_us > 0
