"""apex port, CPU side: every host check raises a clear exception before any launch (with CPU
tensors, so the device check must come last), cu_seqlens validation, the registry entries and
their refusals. (rope.cu compiling for sm_90 is tests/test_compile_cuda.py.)"""
from __future__ import annotations

import pytest
import torch

from ports import apex, registry
from ports.apex import fused_rotary_positional_embedding as ext
from reference.case import RopeCase

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _t(*shape, dtype=F32):
    return torch.zeros(shape, dtype=dtype)


S, B, H, D = 4, 2, 3, 8
GOOD = dict(t=_t(S, B, H, D), freqs=_t(S, 1, 1, D))


def _sbhd(**kw):
    a = dict(GOOD, **kw)
    return lambda: apex.fused_apply_rotary_pos_emb(a["t"], a["freqs"])


def _cached(t=None, cos=None, sin=None):
    t = _t(S, B, H, D) if t is None else t
    cos = _t(S, 1, 1, D) if cos is None else cos
    sin = _t(S, 1, 1, D) if sin is None else sin
    return lambda: apex.fused_apply_rotary_pos_emb_cached(t, cos, sin)


def _thd(t=None, cu=None, freqs=None):
    t = _t(10, H, D) if t is None else t
    cu = torch.tensor([0, 3, 10], dtype=torch.int32) if cu is None else cu
    freqs = _t(8, 1, 1, D) if freqs is None else freqs
    return lambda: apex.fused_apply_rotary_pos_emb_thd(t, cu, freqs)


def _two_d(t=None, img=(2, 3), ch=None, sh=None, cw=None, sw=None):
    t = _t(B, 6, H, D) if t is None else t
    ch = _t(1, 2, 1, D // 2) if ch is None else ch
    sh = ch if sh is None else sh
    cw = _t(1, 3, 1, D // 2) if cw is None else cw
    sw = cw if sw is None else sw
    return lambda: apex.fused_apply_rotary_pos_emb_2d(t, *img, ch, sh, cw, sw)


BAD = {
    # the original's TORCH_CHECKs, sbhd freqs path (.cpp fwd / bwd)
    "sbhd: input rank": (_sbhd(t=_t(S, B, D)), ValueError, "expected 4D tensor"),
    "sbhd: freqs rank": (_sbhd(freqs=_t(S, D)), ValueError, "expected 4D tensor"),
    "sbhd: seq length": (_sbhd(freqs=_t(S + 1, 1, 1, D)), ValueError, "same sequence length"),
    "sbhd: freqs dims 1,2": (_sbhd(freqs=_t(S, 2, 1, D)), ValueError, "second and third dims"),
    "sbhd: d2 > d": (_sbhd(freqs=_t(S, 1, 1, D + 2)), ValueError, "equals or is greater"),
    "sbhd: freqs fp16": (_sbhd(freqs=_t(S, 1, 1, D, dtype=F16)), TypeError, "must be float"),
    "sbhd: input fp64": (_sbhd(t=_t(S, B, H, D, dtype=torch.float64)), TypeError,
                         "not implemented for 'Double'"),
    # added checks
    "sbhd: freqs not dense": (_sbhd(freqs=_t(S, 1, 1, 2 * D)[..., ::2]), ValueError, "contiguous"),
    "sbhd: odd d2": (_sbhd(freqs=_t(S, 1, 1, D - 1)), ValueError, "multiple of 2"),
    "sbhd: b past grid": (_sbhd(t=_t(1, 65536, 1, 2), freqs=_t(1, 1, 1, 2)), NotImplementedError,
                          "grid"),
    "sbhd: int32 offsets": (
        _sbhd(t=torch.empty_strided((2, 1, 1, 4), (2**31, 4, 4, 1), dtype=F16, device="meta"),
              freqs=_t(2, 1, 1, 4)), NotImplementedError, "32-bit"),
    "sbhd: not a tensor": (_sbhd(t=[1.0]), TypeError, "torch.Tensor"),
    # cached
    "cached: cos rank": (_cached(cos=_t(S, D)), ValueError, "expected 4D tensor"),
    "cached: sin seq length": (_cached(sin=_t(S - 1, 1, 1, D)), ValueError,
                               "input and sin tensor have the same sequence length"),
    "cached: cos dims 1,2": (_cached(cos=_t(S, 1, 2, D)), ValueError,
                             "dims of the cos tensor equal 1"),
    "cached: last dims differ": (_cached(sin=_t(S, 1, 1, D - 2)), ValueError, "same last dim"),
    "cached: d2 > d": (_cached(cos=_t(S, 1, 1, D + 2), sin=_t(S, 1, 1, D + 2)), ValueError,
                       "equals or is greater"),
    "cached: dtypes differ": (_cached(sin=_t(S, 1, 1, D, dtype=F16)), TypeError, "same dtype"),
    "cached: fp32 x with fp16 tables": (
        _cached(cos=_t(S, 1, 1, D, dtype=F16), sin=_t(S, 1, 1, D, dtype=F16)), TypeError,
        "not supported for 'Float' with 'Half'"),
    "cached: bf16 x with fp16 tables": (
        _cached(t=_t(S, B, H, D, dtype=BF16), cos=_t(S, 1, 1, D, dtype=F16),
                sin=_t(S, 1, 1, D, dtype=F16)), TypeError, "'BFloat16' with 'Half'"),
    "cached: fp64 tables": (
        _cached(cos=_t(S, 1, 1, D, dtype=torch.float64), sin=_t(S, 1, 1, D, dtype=torch.float64)),
        TypeError, "with 'Double'"),
    "cached: odd d2": (_cached(cos=_t(S, 1, 1, 5), sin=_t(S, 1, 1, 5)), ValueError,
                       "multiple of 2"),
    # thd
    "thd: input rank": (_thd(t=_t(10, 1, H, D)), ValueError, "expected 3D tensor"),
    "thd: cu_seqlens rank": (_thd(cu=torch.zeros(1, 3, dtype=torch.int32)), ValueError,
                             "expected 1D tensor"),
    "thd: freqs rank": (_thd(freqs=_t(8, D)), ValueError, "expected 4D tensor"),
    "thd: freqs dims 1,2": (_thd(freqs=_t(8, 1, 3, D)), ValueError, "second and third dims"),
    "thd: d2 > d": (_thd(freqs=_t(8, 1, 1, D + 2)), ValueError, "equals or is greater"),
    "thd: freqs bf16": (_thd(freqs=_t(8, 1, 1, D, dtype=BF16)), TypeError, "must be float"),
    "thd: cu_seqlens int64": (_thd(cu=torch.tensor([0, 3, 10])), TypeError, "int32"),
    "thd: cu_seqlens empty": (_thd(cu=torch.zeros(0, dtype=torch.int32)), ValueError,
                              "at least one"),
    "thd: decreasing": (_thd(cu=torch.tensor([0, 6, 4, 10], dtype=torch.int32)), ValueError,
                        "non-decreasing"),
    "thd: past the end": (_thd(cu=torch.tensor([0, 5, 11], dtype=torch.int32)), ValueError,
                          "exceeds the 10 packed tokens"),
    "thd: longer than max_s": (_thd(cu=torch.tensor([0, 9, 10], dtype=torch.int32)), ValueError,
                               "max_s = 8"),
    "thd: negative start": (_thd(cu=torch.tensor([-2, 3, 10], dtype=torch.int32)), ValueError,
                            ">= 0"),
    # 2-D: the wrapper's assertions, then the .cpp's checks
    "2d: t rank": (_two_d(t=_t(6, H, D)), ValueError, "4D"),
    "2d: s != img_h * img_w": (_two_d(img=(2, 2)), ValueError, "img_h \\* img_w"),
    "2d: sin_h shape": (_two_d(sh=_t(1, 3, 1, D // 2)), ValueError, "cos_h and sin_h"),
    "2d: sin_w shape": (_two_d(sw=_t(1, 4, 1, D // 2)), ValueError, "cos_w and sin_w"),
    "2d: cos_h rank": (_two_d(ch=_t(2, D // 2), sh=_t(2, D // 2)), ValueError,
                       "cos_h to be 4D"),
    "2d: cos_h dim 2": (_two_d(ch=_t(1, 2, 2, D // 2)), ValueError, "third dim of cos_h"),
    "2d: height": (_two_d(ch=_t(1, 1, 1, D // 2)), ValueError, "height <= cos_h"),
    "2d: width": (_two_d(cw=_t(1, 2, 1, D // 2)), ValueError, "width <= cos_w"),
    "2d: cos_h width": (_two_d(ch=_t(1, 2, 1, D)), ValueError, "head dim / 2"),
    "2d: pair fp32 x fp16 tables": (
        _two_d(ch=_t(1, 2, 1, D // 2, dtype=F16), cw=_t(1, 3, 1, D // 2, dtype=F16)), TypeError,
        "not supported for 'Float' with 'Half'"),
    "2d: cos_w dtype differs": (
        _two_d(t=_t(B, 6, H, D, dtype=F16), cw=_t(1, 3, 1, D // 2, dtype=F16)), TypeError,
        "cos_w has dtype Half but cos_h has Float"),
    "2d: d % 4": (_two_d(t=_t(B, 6, H, 6), ch=_t(1, 2, 1, 3), cw=_t(1, 3, 1, 3)), ValueError,
                  "multiple of 4"),
}


@pytest.mark.parametrize("name", BAD)
def test_host_check_raises(name):
    call, exc, match = BAD[name]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("call", [_sbhd(), _cached(), _thd(), _two_d()],
                         ids=["sbhd", "cached", "thd", "2d"])
def test_valid_cpu_inputs_fail_only_the_device_check(call):
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        call()


def test_backward_entry_points_check_too():
    with pytest.raises(ValueError, match="output_grads tensor equals or is greater"):
        ext.backward(_t(S, B, H, 4), _t(S, 1, 1, 8), False)
    with pytest.raises(ValueError, match="output_grads and cos tensor"):
        ext.backward_cached(_t(S, B, H, D), _t(1, 1, 1, D), _t(1, 1, 1, D), True)
    with pytest.raises(ValueError, match="non-decreasing"):
        ext.backward_thd(_t(10, H, D), torch.tensor([0, 4, 2], dtype=torch.int32), _t(8, 1, 1, D))
    with pytest.raises(ValueError, match="output_grads to be 5D"):
        ext.backward_2d(_t(B, 6, H, D), *[_t(1, 3, 1, D // 2)] * 4)


def test_validate_cu_seqlens_returns_the_covered_rows():
    cu = torch.tensor([2, 2, 5, 9], dtype=torch.int32)
    assert ext.validate_cu_seqlens(cu, total=12, max_s=4) == (2, 9)
    assert ext.validate_cu_seqlens(torch.tensor([0], dtype=torch.int32), 0, 0) == (0, 0)


def test_kernels_are_every_instantiation_without_fast_math():
    assert len(ext.MODULE.kernels) == 4 * 3 + 4 * 5
    assert "apex_rope_cached_fwd<ApexHalf, float>" in ext.MODULE.kernels
    assert "apex_rope_2d_bwd<ApexBFloat16, ApexBFloat16>" in ext.MODULE.kernels
    assert not any("fast_math" in o for o in ext.MODULE.options)
    assert apex.MODULE is ext.MODULE  # exposed at package level for test_compile_cuda


# ---- registry ------------------------------------------------------------------------------------
APEX_NAMES = ["apex.fused_rope", "apex.fused_rope_cached", "apex.fused_rope_thd",
              "apex.fused_rope_2d"]


def test_registered():
    assert [s.name for s in registry.select(only=["apex"])] == APEX_NAMES


@pytest.mark.parametrize("name,case,reason", [
    ("apex.fused_rope", RopeCase(2, 8, 2, 16, layout="bhsd"), "layout bhsd"),
    ("apex.fused_rope", RopeCase(2, 8, 2, 16, style="interleaved"), "convention"),
    ("apex.fused_rope", RopeCase(2, 8, 2, 16, positions="offset"), "positions"),
    ("apex.fused_rope", RopeCase(2, 8, 2, 16, asymmetric=True), "asymmetric"),
    ("apex.fused_rope", RopeCase(2, 8, 2, 16, dtype="fp64"), "dtype fp64"),
    ("apex.fused_rope", RopeCase(65536, 1, 1, 8, layout="sbhd"), "grid"),
    ("apex.fused_rope_cached", RopeCase(2, 8, 2, 16, cos_sin_dtype="fp64"), "cos/sin dtype"),
    ("apex.fused_rope_thd", RopeCase(2, 8, 2, 16), "layout bshd"),
    ("apex.fused_rope_2d", RopeCase(2, 8, 2, 16), "rotary_dim = head_dim / 2"),
    ("apex.fused_rope_2d", RopeCase(2, 8, 2, 16, layout="sbhd", rotary_dim=8), "layout sbhd"),
])
def test_unsupported_cases_say_why(name, case, reason):
    assert reason in registry.get(name).unsupported_reason(case)


@pytest.mark.parametrize("name,case", [
    ("apex.fused_rope", RopeCase(2, 8, 2, 16, layout="sbhd", rotary_dim=8)),
    ("apex.fused_rope", RopeCase(2, 8, 2, 16, dtype="bf16", direction="backward",
                                 grad="broadcast")),
    ("apex.fused_rope_cached", RopeCase(2, 8, 2, 16, asymmetric=True, direction="backward")),
    ("apex.fused_rope_cached", RopeCase(2, 8, 2, 16, dtype="fp16", cos_sin_dtype="same")),
    ("apex.fused_rope_thd", RopeCase(3, 8, 2, 16, layout="thd", seqlens=(8, 1, 5))),
    ("apex.fused_rope_2d", RopeCase(2, 8, 2, 16, rotary_dim=8, contiguous=False)),
])
def test_supported_cases(name, case):
    assert registry.get(name).unsupported_reason(case) is None
