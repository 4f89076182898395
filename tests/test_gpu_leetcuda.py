"""LeetCUDA ports on the GPU: correctness against the oracle, every element written, nothing
written out of bounds, torch's current stream honoured."""
from __future__ import annotations

import pytest
import torch

from ports import leetcuda
from reference.case import RopeCase, make_inputs
from reference.expected import expected, tolerances
from reference.tolerances import ANGLE_REL_ERR_FAST_MATH

pytestmark = pytest.mark.gpu

KERNELS = [leetcuda.rope_f32, leetcuda.rope_f32_v2, leetcuda.rope_f32x4_pack]


def _check(kernel, seqlen, hidden, seed=0):
    case = RopeCase(1, seqlen, 1, hidden, style="interleaved")
    inp = make_inputs(case, seed=seed, device="cuda")
    x = inp.x.view(seqlen, hidden)
    out = torch.full_like(x, float("nan"))
    kernel(x, out)
    torch.cuda.synchronize()
    ref = expected(case, inp, "computed")[0].view(seqlen, hidden)
    tol = tolerances(case, inp, (ref.view(inp.x.shape),), steps=4,
                     angle_rel_err=ANGLE_REL_ERR_FAST_MATH)[0].view(seqlen, hidden)
    assert not torch.isnan(out).any(), "unwritten elements"
    err = (out.double() - ref).abs()
    assert (err <= tol).all(), f"max err {err.max():.3g}, worst err/tol {(err / tol).max():.3g}"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("seqlen,hidden", [(1, 4), (7, 12), (333, 64), (4096, 512), (5, 1024)])
def test_matches_oracle(kernel, seqlen, hidden):
    if kernel is leetcuda.rope_f32x4_pack and hidden % 4:
        pytest.skip("float4 kernel needs hidden % 4 == 0")
    _check(kernel, seqlen, hidden, seed=seqlen)


@pytest.mark.parametrize("kernel", [leetcuda.rope_f32, leetcuda.rope_f32x4_pack],
                         ids=lambda k: k.__name__)
def test_no_write_past_the_end(kernel):
    # seq_len * N is not a multiple of 256: upstream's threads past the end would write here.
    seqlen, hidden = 3, 12
    buf = torch.full((seqlen * hidden + 1024,), 7.0, device="cuda")
    x = torch.randn(seqlen, hidden, device="cuda")
    out = buf[: seqlen * hidden].view(seqlen, hidden)
    kernel(x, out)
    torch.cuda.synchronize()
    assert (buf[seqlen * hidden:] == 7.0).all()


def test_launches_on_torch_current_stream():
    x = torch.randn(512, 128, device="cuda")
    fresh = torch.randn_like(x)
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms: anything on another stream would run first
        x.copy_(fresh)
        leetcuda.rope_f32(x, out)
    side.synchronize()
    expect = torch.empty_like(out)
    leetcuda.rope_f32(fresh, expect)
    torch.cuda.synchronize()
    assert torch.equal(out, expect)


def test_module_is_compiled_once_per_device():
    from ports import _cupy

    leetcuda.rope_f32(torch.randn(4, 8, device="cuda"), torch.empty(4, 8, device="cuda"))
    before = _cupy._load.cache_info()
    leetcuda.rope_f32(torch.randn(4, 8, device="cuda"), torch.empty(4, 8, device="cuda"))
    leetcuda.rope_f32_v2(torch.randn(4, 8, device="cuda"), torch.empty(4, 8, device="cuda"))
    assert _cupy._load.cache_info() == before  # no new compile, not even a cache lookup
    assert list(leetcuda.MODULE._per_device) == [torch.cuda.current_device()]


def test_empty_input_launches_nothing():
    x = torch.empty(0, 8, device="cuda")
    leetcuda.rope_f32(x, torch.empty_like(x))
