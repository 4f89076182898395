"""The TE port's host side on the CPU: TE's checks and the port's added ones (each names what is
wrong), the launch heuristic, the kernel list, and the registry entries. The kernels themselves
compile for sm_90 in tests/test_compile_cuda.py and run in tests/test_gpu_te.py."""
from __future__ import annotations

import pytest
import torch

from ports import registry, te
from ports.te import _launch
from reference.case import RopeCase

S, B, H, D = 8, 2, 3, 16
I32 = torch.int32


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


def _fwd(t=None, freqs=None, **kw):
    return lambda: te.fused_rope_forward(_t(S, B, H, D) if t is None else t,
                                         _t(S, 1, 1, D) if freqs is None else freqs, **kw)


def _thd(cu, t=None, freqs=None, **kw):
    return _fwd(_t(10, H, D) if t is None else t, freqs, qkv_format="thd",
                cu_seqlens=cu, **kw)


BAD = {
    "freqs rank": (_fwd(freqs=_t(S, D)), ValueError, "4D"),
    "freqs dims 1, 2": (_fwd(freqs=_t(S, 2, 1, D)), ValueError, "second and third"),
    "freqs dtype": (_fwd(freqs=_t(S, 1, 1, D, dtype=torch.float16)), TypeError, "must be float"),
    "freqs strided": (_fwd(freqs=_t(S, 1, 1, 2 * D)[..., ::2]), ValueError, "contiguous"),
    "format": (_fwd(qkv_format="bhsd"), ValueError, "tensor_format"),
    "input rank": (_fwd(t=_t(S, H, D)), ValueError, "4D"),
    "input dtype": (_fwd(t=_t(S, B, H, D, dtype=torch.float64)), TypeError, "dtype"),
    "freqs too short": (_fwd(freqs=_t(S - 1, 1, 1, D)), ValueError, "longer sequence"),
    "d2 > d": (_fwd(freqs=_t(S, 1, 1, 2 * D)), ValueError, "greater than the freqs"),
    "odd d2": (_fwd(freqs=_t(S, 1, 1, D - 1)), ValueError, "even"),
    "cp rank": (_fwd(cp_size=2, cp_rank=2, freqs=_t(2 * S, 1, 1, D)), ValueError, "cp_rank"),
    "start int64": (_fwd(start_positions=torch.zeros(B, dtype=torch.int64)), TypeError, "int32"),
    "start rank": (_fwd(start_positions=torch.zeros(B, 1, dtype=I32)), ValueError, "1-D"),
    "start past freqs": (_fwd(start_positions=torch.tensor([0, 1], dtype=I32)), ValueError,
                         "read past"),
    "start negative": (_fwd(start_positions=torch.tensor([0, -1], dtype=I32),
                            freqs=_t(2 * S, 1, 1, D)), ValueError, ">= 0"),
    "thd rank": (_thd(torch.tensor([0, 10], dtype=I32), t=_t(10, H, D, 1)), ValueError, "3D"),
    "thd no cu_seqlens": (_thd(None), ValueError, "cu_seqlens"),
    "thd cu int64": (_thd(torch.tensor([0, 4, 10])), TypeError, "int32"),
    "thd decreasing": (_thd(torch.tensor([0, 6, 4, 10], dtype=I32)), ValueError, "rise"),
    "thd short": (_thd(torch.tensor([0, 4, 9], dtype=I32)), ValueError, "rise"),
    "thd longer than freqs": (_thd(torch.tensor([0, 9, 10], dtype=I32)), ValueError,
                              "needs 9 freqs rows"),
    "thd cp odd": (_thd(torch.tensor([0, 6, 20], dtype=I32), cp_size=2, freqs=_t(20, 1, 1, D)),
                   ValueError, "even local"),
}


@pytest.mark.parametrize("name", BAD)
def test_host_check_raises(name):
    call, exc, match = BAD[name]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("call", [
    _fwd(), _fwd(qkv_format="bshd", t=_t(B, S, H, D)),
    _fwd(start_positions=torch.tensor([0, 3], dtype=I32), freqs=_t(2 * S, 1, 1, D)),
    _thd(torch.tensor([0, 3, 10], dtype=I32)),
    _thd(torch.tensor([0, 8, 20], dtype=I32), cp_size=2, cp_rank=1, freqs=_t(20, 1, 1, D))],
    ids=["sbhd", "bshd", "start", "thd", "thd-cp"])
def test_valid_cpu_inputs_fail_only_the_device_check(call):
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        call()


def test_backward_checks_too():
    with pytest.raises(ValueError, match="greater than the freqs"):
        te.fused_rope_backward(_t(S, B, H, 4), _t(S, 1, 1, 8))


def test_linear_grid_heuristic_is_the_originals():
    assert not _launch.use_linear_grid(8 * 4, 20, 1)            # few wasted blocks
    assert _launch.use_linear_grid(4096 * 64, 4096 + 63, 1)      # one long, many short
    assert not _launch.use_linear_grid(4096 * 64, 4096 * 40, 1)  # not twice as many
    assert not _launch.use_linear_grid(100_000, 0, 1)


def test_kernels_are_every_instantiation_without_fast_math():
    assert len(_launch.MODULE.kernels) == 2 * 3 * 2
    assert "te_rope_thd_linear<__nv_bfloat16, true>" in _launch.MODULE.kernels
    assert not any("fast_math" in o for o in _launch.MODULE.options)


def test_registered_beside_the_te15_generation():
    assert [s.name for s in registry.select(only=["te"])] == ["te.fused_rope", "te.fused_rope_thd"]
    spec = registry.get("te.fused_rope")
    assert spec.unsupported_reason(RopeCase(2, 8, 2, 16, style="interleaved", positions="offset",
                                            rotary_dim=8, direction="backward")) is None
    assert "positions 'ids'" in spec.unsupported_reason(RopeCase(2, 8, 2, 16, positions="ids"))
    assert "layout bhsd" in spec.unsupported_reason(RopeCase(2, 8, 2, 16, layout="bhsd"))
    thd = RopeCase(3, 8, 2, 16, layout="thd", seqlens=(8, 1, 5))
    assert registry.get("te.fused_rope_thd").unsupported_reason(thd) is None


def test_claims_of_seeds_000_and_002_name_the_te_generation():
    from ports.harness import claims

    for generation, name in claims.TE_GENERATIONS.items():
        assert registry.get(name).family in ("apex", "te")
    rows = claims.unmeasured("no GPU")
    for seed in ("000", "002"):
        texts = [c.claim for c in rows if c.seed == seed]
        assert any("TE 1.5 generation" in t for t in texts)
        assert any("TE 2.x" in t for t in texts)
