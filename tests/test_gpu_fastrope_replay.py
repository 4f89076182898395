"""The mutating ops' C++ kernels on the GPU (replay.cpp): a replayed call writes what the Python
implementation writes, and every call that needs Python still gets it.

* The op matrix of tests/test_fastrope_ops.py (styles, layouts, full and half tables, computed
  angles, every position form, partial rotary, GQA), with and without the position check, each
  geometry called three times on fresh inputs: in place and into given outputs, bit for bit
  against the Python implementation (``run.rotate``, the same plan). With nothing for the check
  to read and the tables used as given, the second and third calls are replayed.
* The default and fp64 frequencies of computed angles are replayed; fp32 ones (converted per
  call) are not.
* Per-call refusals: a position check with something to read runs each call (a bad position
  raises), an output overlapping an input raises, an inverse rotation with k sharing q's memory
  is right.
* A replayed call from a thread with no CUDA context, inside a CUDA-graph capture (on the
  capturing stream), under ``torch.compile(fullgraph=True)``, and its version counter bump.
"""
from __future__ import annotations

import threading

import pytest
import torch

from ports.fastrope import apply_rope, apply_rope_inplace, replay, run
from reference.tables import inv_freq as fp64_inv_freq
from reference.tables import rope_tables
from test_fastrope_ops import _case_args, _matrix

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _replay_loaded():
    if torch.cuda.is_available() and not replay.loaded():
        pytest.fail(f"replay.cpp is not serving the ops on this GPU machine: {replay.reason}")


def _counts() -> tuple[int, int]:
    replayed, planned = torch.ops.fastrope.replay_counts()
    return replayed, planned


def _python(q, k, rest, *, in_place, inverse=False):
    """The Python implementation's result, on copies."""
    (cos, sin, positions, offsets, offset, cu, max_seqlen, style, layout, rot, base, inv,
     check) = rest
    qc, kc = q.clone(), None if k is None else k.clone()
    out = run.rotate(qc, kc, in_place=in_place, inverse=inverse, check_positions=check, cos=cos,
                     sin=sin, positions=positions, offsets=offsets if offsets is not None
                     else (offset or None), cu_seqlens=cu, max_seqlen=max_seqlen, style=style,
                     layout=layout, rotary_dim=rot, base=base, inv_freq=inv)
    return (out,) if k is None else tuple(out)


def _fresh(x):
    return None if x is None else torch.randn_like(x)


def _three_calls(q, k, rest):
    """Three calls of rope_ and of rope_out on fresh inputs of one geometry, each against the
    Python implementation; returns the (replayed, planned) counts they added."""
    before = _counts()
    for _ in range(3):
        q, k = _fresh(q), _fresh(k)
        qi, ki = q.clone(), None if k is None else k.clone()
        torch.ops.fastrope.rope_(qi, ki, *rest)
        for got, want in zip((qi, ki), _python(q, k, rest, in_place=True)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        outs = [torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)
                for x in (q, k) if x is not None]
        torch.ops.fastrope.rope_out(q, k, outs[0], outs[1] if k is not None else None, *rest,
                                    False)
        for got, want in zip(outs, _python(q, k, rest, in_place=False)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    after = _counts()
    return after[0] - before[0], after[1] - before[1]


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("case", _matrix(), ids=lambda c: "-".join(map(str, c)))
def test_replayed_calls_write_what_python_writes(case, check):
    q, k, rest = _case_args(*case, device="cuda")
    rest = rest[:-1] + (check,)
    replayed, planned = _three_calls(q, k, rest)
    assert replayed + planned == 6
    source = case[2]
    if not check and source != "computed":  # tables as given, nothing to check: replayed
        assert (replayed, planned) == (4, 2)
    if source == "computed":  # fp32 frequencies, converted per call: Python each time
        assert (replayed, planned) == (0, 6)


@pytest.mark.parametrize("frequencies", ["default", "fp64"])
def test_computed_angles_from_fp64_frequencies_are_replayed(frequencies):
    q = torch.randn(2, 7, 4, 64, device=DEV)
    k = torch.randn(2, 7, 2, 64, device=DEV)
    inv = fp64_inv_freq(64, 500.0, device=DEV) if frequencies == "fp64" else None
    rest = (None, None, None, None, 0, None, None, "rotate_half", "bshd", None, 500.0, inv, True)
    assert _three_calls(q, k, rest) == (4, 2)


def test_a_checked_call_with_positions_runs_python_each_time_and_refuses_a_bad_one():
    q = torch.randn(1, 6, 4, 32, device=DEV)
    cos, sin = rope_tables(16, 32, device=DEV)
    ids = torch.arange(6, device=DEV).unsqueeze(0)
    rest = (cos, sin, ids, None, 0, None, None, "rotate_half", "bshd", None, 10000.0, None, True)
    before = _counts()
    for _ in range(2):
        torch.ops.fastrope.rope_(q, None, *rest)
    assert _counts()[0] == before[0]
    bad = ids.clone()
    bad[0, 3] = 16
    with pytest.raises(IndexError, match="positions reach"):
        torch.ops.fastrope.rope_(q, None, cos, sin, bad, *rest[3:])


def test_bad_input_on_the_c_kernel_raises_pythons_exception():
    q = torch.randn(1, 6, 4, 32, device=DEV)
    cos, sin = rope_tables(16, 32, device=DEV)
    with pytest.raises(ValueError, match="rotary_dim"):
        torch.ops.fastrope.rope_(q, None, cos, sin, None, None, 0, None, None, "rotate_half",
                                 "bshd", 33, 10000.0, None, True)


def test_an_output_overlapping_an_input_is_refused_on_a_replayed_key():
    q = torch.randn(1, 6, 4, 32, device=DEV)
    cos, sin = rope_tables(16, 32, device=DEV)
    rest = (cos, sin, None, None, 0, None, None, "rotate_half", "bshd", None, 10000.0, None,
            True, False)
    for _ in range(2):
        torch.ops.fastrope.rope_out(q, None, torch.empty_like(q), None, *rest)
    with pytest.raises(ValueError, match="overlaps"):
        torch.ops.fastrope.rope_out(q, None, q, None, *rest)
    both = torch.empty(2, *q.shape, device=DEV)  # q_out and k_out of one storage, apart
    k = torch.randn_like(q)
    torch.ops.fastrope.rope_out(q, k, both[0], both[1], *rest)
    wide = torch.empty(q.numel() + 32, device=DEV)  # k_out overlapping q_out
    with pytest.raises(ValueError, match="overlaps"):
        torch.ops.fastrope.rope_out(q, k, wide[:q.numel()].view_as(q),
                                    wide[32:].view_as(q), *rest)


def test_an_inverse_rotation_with_k_sharing_q_is_right():
    q = torch.randn(1, 6, 4, 32, device=DEV)
    cos, sin = rope_tables(16, 32, device=DEV)
    rest = (cos, sin, None, None, 0, None, None, "rotate_half", "bshd", None, 10000.0, None,
            False, True)
    for _ in range(2):  # k apart from q: the key is planned, then replayed
        torch.ops.fastrope.rope_out(q, torch.randn_like(q), torch.empty_like(q),
                                    torch.empty_like(q), *rest)
    for _ in range(2):
        q = torch.randn_like(q)
        outs = [torch.empty_like(q), torch.empty_like(q)]
        torch.ops.fastrope.rope_out(q, q, outs[0], outs[1], *rest)
        want = run.rotate(q, q.clone(), in_place=False, inverse=True, cos=cos, sin=sin)
        torch.testing.assert_close(outs[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(outs[1], want[1], rtol=0, atol=0)


def _tables_call(q, cos, sin):
    torch.ops.fastrope.rope_(q, None, cos, sin, None, None, 0, None, None, "rotate_half", "bshd",
                             None, 10000.0, None, False)


def test_a_replayed_call_from_a_thread_with_no_cuda_context():
    q = torch.randn(2, 9, 4, 64, device=DEV)
    cos, sin = rope_tables(16, 64, device=DEV)
    _tables_call(q.clone(), cos, sin)  # planned here: the thread's call replays
    want = _python(q, None, (cos, sin, None, None, 0, None, None, "rotate_half", "bshd", None,
                             10000.0, None, False), in_place=True)[0]
    got, errors = q.clone(), []
    before = _counts()

    def work():
        try:
            _tables_call(got, cos, sin)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    assert _counts()[0] == before[0] + 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_replayed_call_is_captured_in_a_cuda_graph():
    q = torch.randn(2, 9, 4, 64, device=DEV)
    cos, sin = rope_tables(16, 64, device=DEV)
    _tables_call(q.clone(), cos, sin)
    rest = (cos, sin, None, None, 0, None, None, "rotate_half", "bshd", None, 10000.0, None,
            False)
    static = q.clone()
    before = _counts()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a launch off the capturing stream would fail the capture
        _tables_call(static, cos, sin)
    assert _counts()[0] == before[0] + 1
    for _ in range(2):
        fresh = torch.randn_like(q)
        static.copy_(fresh)
        graph.replay()
        torch.testing.assert_close(static, _python(fresh, None, rest, in_place=True)[0],
                                   rtol=0, atol=0)


def test_a_replayed_call_bumps_the_version_counter():
    q = torch.randn(2, 9, 4, 64, device=DEV)
    cos, sin = rope_tables(16, 64, device=DEV)
    _tables_call(q, cos, sin)
    before, counts = q._version, _counts()
    _tables_call(q, cos, sin)
    assert _counts()[0] == counts[0] + 1 and q._version == before + 1
    out = torch.empty_like(q)
    for _ in range(2):
        torch.ops.fastrope.rope_out(q, None, out, None, cos, sin, None, None, 0, None, None,
                                    "rotate_half", "bshd", None, 10000.0, None, False, False)
    v = out._version
    torch.ops.fastrope.rope_out(q, None, out, None, cos, sin, None, None, 0, None, None,
                                "rotate_half", "bshd", None, 10000.0, None, False, False)
    assert out._version == v + 1


def test_compiled_calls_are_replayed():
    cos, sin = rope_tables(64, 64, device=DEV)

    def step(q, k):
        q2, k2 = apply_rope(q, k, cos=cos, sin=sin)
        apply_rope_inplace(q2, k2, cos=cos, sin=sin)
        return q2, k2

    compiled = torch.compile(step, fullgraph=True)
    before = _counts()
    for _ in range(4):
        q = torch.randn(2, 16, 8, 64, device=DEV)
        k = torch.randn(2, 16, 2, 64, device=DEV)
        got = compiled(q, k)
        want = step(q, k)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    replayed = _counts()[0] - before[0]
    assert replayed >= 6  # two ops a call, each planned once
