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
