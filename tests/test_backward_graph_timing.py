"""A backward case's CUDA-graph time (``compare.py --graph``): its prepared call steps the forward
and backward as one (autograd runs a backward on its forward's stream, so a capture holds the
backward only with its forward), and the runner takes the step's graph time less the
forward's. Runs on the CPU with the timers stubbed."""
from __future__ import annotations

import torch

from ports import registry
from ports._adapters import AutogradCall
from ports.harness import runner, timing
from reference.case import RopeCase, make_inputs

CASE = RopeCase(2, 16, 4, 32, direction="backward", kv_heads=2)


def test_a_backward_call_steps_the_same_gradients():
    spec = registry.get("torch.hf_rotate_half")
    fn = spec.prepare(CASE, make_inputs(CASE, seed=0))
    assert isinstance(fn, AutogradCall)
    step, forward = fn.graph_parts()
    first, again, stepped = fn(), fn(), step()
    assert len(first) == 2  # dq and dk
    for a, b, c in zip(first, again, stepped):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert all(o.requires_grad for o in forward())


def test_backward_graph_time_is_the_step_less_the_forward(monkeypatch):
    timed = []

    def graph_median_us(fn, **kw):
        timed.append(fn)
        return 12.0 if getattr(fn, "__name__", "") == "step" else 4.0  # the step, the forward

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
    assert len(timed) == 2 and timed[0].__name__ == "step"
    assert timing.backward_graph_us(lambda: None, lambda: None) == 0.0  # never below 0
    plain = runner.run_case(CASE, [spec], timing_on=True, graph=False,
                            device=torch.device("cpu"))
    assert plain.results[0].graph_us is None
