"""Paddle V1 port on the CPU: every host check, the launch plumbing, and the registry mapping.

The host checks run before any launch and the device check comes last, so CPU tensors reach
every other check. The launch plumbing (one launch for q/k/v, two for GQA, the sign of the
backward, the typed scalars) is checked with the launch itself replaced by a recorder.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ports import _cupy, paddle, registry
from ports.paddle import canonical
from ports.paddle import launch_config_1d
from reference.case import RopeCase, make_inputs

rope = paddle.fused_rotary_position_embedding


def _q(shape=(2, 8, 4, 16), dtype=torch.float32):
    return torch.randn(shape, dtype=torch.float32).to(dtype)


def _tables(rows=8, dim=16, dtype=torch.float32):
    return torch.rand(rows, dim).to(dtype), torch.rand(rows, dim).to(dtype)


# ---- host checks --------------------------------------------------------------------------------
def test_valid_cpu_inputs_reach_the_device_check_last():
    q = _q()
    sin, cos = _tables()
    ids = torch.zeros(2, 8, dtype=torch.int64)
    for kwargs in (dict(), dict(k=q.clone(), v=q.clone()), dict(sin=sin, cos=cos),
                   dict(sin=sin, cos=cos, position_ids=ids, use_neox_rotary_style=False),
                   dict(k=_q((2, 8, 2, 16)), v=_q((2, 8, 2, 16)), sin=sin, cos=cos)):
        with pytest.raises(ValueError, match="must be a CUDA tensor"):
            rope(q, **kwargs)


def test_not_a_tensor():
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        rope(np.zeros((1, 2, 1, 4), np.float32))
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        rope(_q(), k=np.zeros((2, 8, 4, 16)))
    with pytest.raises(TypeError, match="sin must be a torch.Tensor"):
        rope(_q(), sin=np.zeros((8, 16)), cos=torch.zeros(8, 16))


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.float8_e4m3fn])
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match="this port supports"):
        rope(torch.zeros(1, 2, 1, 4, dtype=dtype))


def test_dtype_mismatches():
    q = _q()
    with pytest.raises(TypeError, match="k has dtype torch.float16 but q has"):
        rope(q, k=q.half())
    sin, cos = _tables(dtype=torch.float32)
    with pytest.raises(TypeError, match="must be q's dtype"):
        rope(q.half(), sin=sin, cos=cos)
    with pytest.raises(TypeError, match="position_ids must be int64"):
        rope(q, sin=sin, cos=cos, position_ids=torch.zeros(2, 8, dtype=torch.int32))


def test_flag_and_base_types():
    with pytest.raises(TypeError, match="use_neox_rotary_style must be a bool"):
        rope(_q(), use_neox_rotary_style="interleaved")
    with pytest.raises(TypeError, match="time_major must be a bool"):
        rope(_q(), time_major=1)
    with pytest.raises(TypeError, match="rotary_emb_base must be a float"):
        rope(_q(), rotary_emb_base="10000")


def test_rank_and_head_dim():
    with pytest.raises(ValueError, match=r"q must be 4-D \[batch, seq_len"):
        rope(torch.zeros(8, 16))
    with pytest.raises(ValueError, match=r"q must be 4-D \[seq_len, batch"):
        rope(torch.zeros(8, 16), time_major=True)
    with pytest.raises(ValueError, match="multiple of 2"):
        rope(_q((1, 2, 1, 7)))


def test_rotate_half_needs_head_dim_multiple_of_4():
    sin, cos = _tables(dim=6)
    with pytest.raises(NotImplementedError, match="head_dim % 4 == 0"):
        rope(_q((1, 8, 1, 6)), sin=sin, cos=cos, use_neox_rotary_style=False)
    # every-two is fine with D % 4 == 2: reaches the device check
    with pytest.raises(ValueError, match="CUDA tensor"):
        rope(_q((1, 8, 1, 6)), sin=sin, cos=cos, use_neox_rotary_style=True)


@pytest.mark.parametrize("time_major", [False, True])
def test_k_v_must_match_q_except_heads(time_major):
    q = _q((2, 8, 4, 16))
    for bad in ((1, 8, 4, 16), (3, 8, 4, 16), (2, 7, 4, 16), (2, 8, 4, 8)):
        with pytest.raises(ValueError, match="must match q's"):
            rope(q, k=_q(bad), time_major=time_major)
        with pytest.raises(ValueError, match="must match q's"):
            rope(q, k=q.clone(), v=_q(bad), time_major=time_major)


def test_zero_heads_in_k():
    with pytest.raises(ValueError, match="0 heads"):
        rope(_q(), k=_q((2, 8, 0, 16)))


def test_gqa_head_rules():
    q = _q((2, 8, 6, 16))
    with pytest.raises(ValueError, match="divisible by k,v"):
        rope(q, k=_q((2, 8, 4, 16)))
    with pytest.raises(ValueError, match="divisible by k,v"):
        rope(_q((2, 8, 2, 16)), k=_q((2, 8, 4, 16)))  # more kv heads than q heads
    with pytest.raises(ValueError, match="num_heads of k .* equal to the num_heads of v"):
        rope(q, k=_q((2, 8, 2, 16)), v=_q((2, 8, 3, 16)))
    with pytest.raises(ValueError, match="num_heads of k .* equal to the num_heads of v"):
        rope(q, k=_q((2, 8, 3, 16)), v=_q((2, 8, 2, 16)))


def test_non_contiguous_inputs_are_refused():
    q = _q((2, 4, 8, 16)).transpose(1, 2)
    with pytest.raises(ValueError, match="q must be contiguous"):
        rope(q)
    sin, cos = _tables(rows=8, dim=32)
    with pytest.raises(ValueError, match="sin must be contiguous"):
        rope(_q(), sin=sin[:, ::2], cos=cos[:, ::2])
    ids = torch.zeros(8, 2, dtype=torch.int64).t()
    sin, cos = _tables()
    with pytest.raises(ValueError, match="position_ids must be contiguous"):
        rope(_q(), sin=sin, cos=cos, position_ids=ids)


def test_sin_cos_shapes():
    q = _q()
    sin, cos = _tables()
    with pytest.raises(ValueError, match="give both sin and cos"):
        rope(q, sin=sin)
    with pytest.raises(ValueError, match="give both sin and cos"):
        rope(q, cos=cos)
    with pytest.raises(ValueError, match="dims of sin and cos must be the same"):
        rope(q, sin=sin, cos=cos[:4])
    with pytest.raises(ValueError, match="expected to be 2 or 4"):
        rope(q, sin=sin[None], cos=cos[None])
    with pytest.raises(ValueError, match="batch_size and num_heads of sin and cos must be 1"):
        rope(q, sin=sin.view(1, 8, 1, 16).expand(2, 8, 1, 16).contiguous(),
             cos=cos.view(1, 8, 1, 16).expand(2, 8, 1, 16).contiguous())
    with pytest.raises(ValueError, match="head_dim of sin and cos"):
        rope(q, sin=sin[:, :8].contiguous(), cos=cos[:, :8].contiguous())
    with pytest.raises(ValueError, match=r"must equal q's \(8\) when position_ids"):
        s2, c2 = _tables(rows=9)
        rope(q, sin=s2, cos=c2)
    with pytest.raises(ValueError, match="CUDA tensor"):  # [1, S, 1, D] is accepted
        rope(q, sin=sin.view(1, 8, 1, 16), cos=cos.view(1, 8, 1, 16))


def test_position_ids_checks():
    q = _q()
    sin, cos = _tables(rows=16)
    with pytest.raises(ValueError, match=r"must be >= q's"):
        s2, c2 = _tables(rows=4)
        rope(q, sin=s2, cos=c2, position_ids=torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"position_ids must have shape \[batch_size, seq_len\]"):
        rope(q, sin=sin, cos=cos, position_ids=torch.zeros(8, 2, dtype=torch.int64))
    for bad in (16, -1):
        ids = torch.zeros(2, 8, dtype=torch.int64)
        ids[1, 3] = bad
        with pytest.raises(ValueError, match="read out of bounds"):
            rope(q, sin=sin, cos=cos, position_ids=ids)
        with pytest.raises(ValueError, match="CUDA tensor"):  # the extension switch skips it
            rope(q, sin=sin, cos=cos, position_ids=ids, check_position_ids=False)


def test_upstream_python_assertions_are_not_implemented_errors():
    q = _q()
    with pytest.raises(NotImplementedError, match="position_ids without sin/cos"):
        rope(q, position_ids=torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(NotImplementedError, match="rotate_half without sin/cos"):
        rope(q, use_neox_rotary_style=False)


# ---- launch configuration ------------------------------------------------------------------------
@pytest.mark.parametrize("numel,sms,expect", [
    (0, 132, (0, 64)),                  # nothing to do: the 64-thread floor
    (16, 132, (1, 64)),                 # active 8: 8 // 264 = 0 -> 32 -> floor 64
    (32 * 128, 132, (32, 64)),          # active 2048 // 264 = 7 -> 8 -> 32 -> floor 64
    (64 * 32 * 128, 132, (256, 512)),   # active 131072 // 264 = 496 -> 512
    (105602, 132, (207, 256)),          # active 52801 // 264 = 200 -> 256; ceil(52801/256)
    (158400, 132, (155, 512)),          # active 79200 // 264 = 300 -> 512; ceil(79200/512)
    (270400, 132, (529, 256)),          # // 264 = 512 (not < 512); // 528 = 256 -> 256
    (316800, 132, (310, 512)),          # // 264 = 600; // 528 = 300 -> 512
    (4 * 4096 * 32 * 128, 132, (65536, 512)),  # both quotients >= 512: the 512 limit
])
def test_launch_config_follows_get_gpu_launch_config_1d(numel, sms, expect):
    assert tuple(launch_config_1d(numel, 2, sms)) == expect


def test_launch_config_limits():
    assert launch_config_1d(10**13, 2, 132).blocks == 2**31 - 1  # capped at the grid's x limit
    assert launch_config_1d(10**6, 2, 132, max_threads_per_block=256).threads <= 256
    with pytest.raises(ValueError):
        launch_config_1d(-1, 2, 132)


# ---- launch plumbing, with the launch replaced by a recorder -------------------------------------
@pytest.fixture
def recorder(monkeypatch):
    calls = []
    monkeypatch.setattr(_cupy, "check_cuda", lambda *named: 0)
    monkeypatch.setattr(paddle._launch, "device_limits", lambda index: (132, 1024))
    monkeypatch.setattr(_cupy, "launch",
                        lambda module, name, device, grid, block, args: calls.append(
                            dict(name=name, grid=grid, block=block, args=args)))
    return calls


# argument positions in the kernel signature
IN0, IN1, IN2, SIN, COS, IDS, FLAG, SIGN, B, S, H, D, BSTRIDE, SSTRIDE, NUM, DIVC, BASE, O0, O1, O2 \
    = range(20)


def test_one_launch_for_q_k_v_with_equal_heads(recorder):
    q, k, v = _q(), _q(), _q()
    outs = rope(q, k, v)
    assert len(recorder) == 1
    a = recorder[0]["args"]
    assert recorder[0]["name"] == "paddle_rope_every_two<float, float, 2>"
    assert [int(a[i]) for i in (IN0, IN1, IN2)] == [t.data_ptr() for t in (q, k, v)]
    assert [int(a[i]) for i in (O0, O1, O2)] == [t.data_ptr() for t in outs]
    assert int(a[NUM]) == 3 and int(a[SIN]) == 0 and int(a[FLAG]) == 0 and int(a[SIGN]) == 1
    assert (int(a[B]), int(a[S]), int(a[H]), int(a[D])) == (2, 8, 4, 16)
    assert (int(a[BSTRIDE]), int(a[SSTRIDE])) == (8 * 4 * 16, 4 * 16)
    assert recorder[0]["grid"] == (launch_config_1d(q.numel(), 2, 132).blocks,)
    for i in (B, S, H, D, BSTRIDE, SSTRIDE):
        assert isinstance(a[i], np.int64)
    for i in (FLAG, SIGN, NUM):
        assert isinstance(a[i], np.int32)
    assert isinstance(a[DIVC], np.float32) and isinstance(a[BASE], np.float32)


def test_two_launches_for_gqa_on_q_s_grid(recorder):
    q, k, v = _q((2, 8, 6, 16)), _q((2, 8, 2, 16)), _q((2, 8, 2, 16))
    sin, cos = _tables(rows=2)
    rope(q, k, v, sin=sin, cos=cos, use_neox_rotary_style=False, time_major=True)
    assert len(recorder) == 2
    first, second = (r["args"] for r in recorder)
    assert recorder[0]["name"] == "paddle_rope_rotate_half<float, float, 2>"
    assert int(first[NUM]) == 1 and int(first[H]) == 6 and int(first[IN1]) == 0
    assert int(second[NUM]) == 2 and int(second[H]) == 2
    assert [int(second[i]) for i in (IN0, IN1, IN2)] == [k.data_ptr(), v.data_ptr(), 0]
    # time_major: q is [S=2, B=8, H, D]; kv strides recomputed for kv's head count
    assert (int(second[BSTRIDE]), int(second[SSTRIDE])) == (2 * 16, 8 * 2 * 16)
    assert (int(first[BSTRIDE]), int(first[SSTRIDE])) == (6 * 16, 8 * 6 * 16)
    assert int(first[FLAG]) == 1 and int(first[SIN]) == sin.data_ptr()
    assert int(first[COS]) == cos.data_ptr()
    assert recorder[0]["grid"] == recorder[1]["grid"]


@pytest.mark.parametrize("dtype,storage,divc_type", [
    (torch.float16, "__half", np.float32), (torch.bfloat16, "__nv_bfloat16", np.float32),
    (torch.float64, "double", np.float64)])
def test_kernel_instantiation_and_div_c(recorder, dtype, storage, divc_type):
    rope(_q((1, 4, 1, 12), dtype), rotary_emb_base=500000.0)
    a = recorder[0]["args"]
    assert recorder[0]["name"] == f"paddle_rope_every_two<{storage}, " \
        f"{'double' if dtype == torch.float64 else 'float'}, 2>"
    assert isinstance(a[DIVC], divc_type)
    # (MPType)(1.0f / head_dim): rounded to fp32 even for fp64 math
    assert float(a[DIVC]) == float(np.float32(1.0) / np.float32(12)) != 1.0 / 12
    assert a[BASE] == np.float32(500000.0)


def test_backward_launches_the_same_kernel_with_sign_minus_one(recorder):
    q = _q().requires_grad_(True)
    k = _q().requires_grad_(True)
    sin, cos = _tables(rows=16)
    ids = torch.randint(0, 16, (2, 8))
    out_q, out_k, out_v = rope(q, k, sin=sin, cos=cos, position_ids=ids)
    assert out_v is None and len(recorder) == 1 and int(recorder[0]["args"][SIGN]) == 1
    g = torch.full((), 2.0).expand(q.shape)  # zero-stride gradient, as from out.sum() * 2
    torch.autograd.grad((out_q, out_k), (q, k), (g, torch.ones_like(out_k)))
    assert len(recorder) == 2
    a = recorder[1]["args"]
    assert int(a[SIGN]) == -1 and int(a[NUM]) == 2 and int(a[IDS]) == ids.data_ptr()
    assert int(a[SIN]) == sin.data_ptr() and recorder[1]["name"] == recorder[0]["name"]


def test_no_autograd_graph_without_requires_grad(recorder):
    out_q, out_k, out_v = rope(_q())
    assert out_q.grad_fn is None and out_k is None and out_v is None


def test_empty_q_launches_nothing(recorder):
    out_q, out_k, _ = rope(_q((0, 8, 4, 16)), _q((0, 8, 4, 16)))
    assert not recorder and out_q.shape == (0, 8, 4, 16) and out_k.shape == (0, 8, 4, 16)


def test_module_lists_every_instantiation():
    assert len(paddle.MODULE.kernels) == 8
    for name in paddle.MODULE.kernels:
        assert name.split("<")[0] in paddle.MODULE.source


# ---- the registry mapping (the naming trap) -----------------------------------------------------
@pytest.fixture
def captured(monkeypatch):
    calls = []

    def fake(q, k=None, v=None, sin=None, cos=None, position_ids=None, use_neox_rotary_style=True,
             time_major=False, rotary_emb_base=10000.0, *, check_position_ids=True):
        calls.append(dict(q=q, k=k, v=v, sin=sin, cos=cos, position_ids=position_ids,
                          use_neox_rotary_style=use_neox_rotary_style, time_major=time_major,
                          rotary_emb_base=rotary_emb_base))
        return q.clone(), (None if k is None else k.clone()), (None if v is None else v.clone())

    monkeypatch.setattr(paddle, "fused_rotary_position_embedding", fake)
    return calls


@pytest.mark.parametrize("style,flag", [("interleaved", True), ("rotate_half", False)])
@pytest.mark.parametrize("name", ["paddle.fused_rope", "paddle.fused_rope_qkv"])
def test_registry_maps_the_inverted_flag(captured, style, flag, name):
    case = RopeCase(1, 4, 1, 4, style=style, kv_heads=1)
    spec = registry.get(name)
    assert spec.unsupported_reason(case) is None
    spec.prepare(case, make_inputs(case))()
    assert captured and all(c["use_neox_rotary_style"] is flag for c in captured)


def test_computed_entry_is_interleaved_only(captured):
    spec = registry.get("paddle.fused_rope_computed")
    assert "convention" in spec.unsupported_reason(RopeCase(1, 4, 1, 4, style="rotate_half"))
    case = RopeCase(2, 4, 2, 8, style="interleaved", base=500000.0, dtype="fp64")
    spec.prepare(case, make_inputs(case))()
    (c,) = captured
    assert c["use_neox_rotary_style"] is True and c["sin"] is None and c["cos"] is None
    assert c["position_ids"] is None and c["rotary_emb_base"] == 500000.0


@pytest.mark.parametrize("layout,time_major", [("bshd", False), ("sbhd", True)])
@pytest.mark.parametrize("positions", ["arange", "offset", "ids"])
def test_registry_tables_and_positions(captured, layout, time_major, positions):
    case = RopeCase(2, 6, 2, 8, layout=layout, positions=positions, kv_heads=2,
                    max_position=20, base=20000.0)
    inputs = make_inputs(case)
    registry.get("paddle.fused_rope_qkv").prepare(case, inputs)()
    (c,) = captured
    assert c["time_major"] is time_major and c["k"] is inputs.xs[1]
    assert c["rotary_emb_base"] == 20000.0
    if positions == "arange":
        assert c["position_ids"] is None
        assert torch.equal(c["sin"], inputs.sin[:6]) and torch.equal(c["cos"], inputs.cos[:6])
    else:
        assert torch.equal(c["position_ids"], inputs.positions)
        assert torch.equal(c["sin"], inputs.sin) and torch.equal(c["cos"], inputs.cos)


def test_per_tensor_entry_calls_once_per_tensor(captured):
    case = RopeCase(1, 4, 4, 8, kv_heads=2)
    registry.get("paddle.fused_rope").prepare(case, make_inputs(case))()
    assert len(captured) == 2 and all(c["k"] is None for c in captured)


def test_registry_reasons():
    rope_, qkv, computed = (registry.get(n) for n in
                            ("paddle.fused_rope", "paddle.fused_rope_qkv",
                             "paddle.fused_rope_computed"))
    assert "head_dim % 4" in rope_.unsupported_reason(RopeCase(1, 4, 1, 6))
    assert rope_.unsupported_reason(RopeCase(1, 4, 1, 6, style="interleaved")) is None
    assert "q's dtype" in rope_.unsupported_reason(RopeCase(1, 4, 1, 8, dtype="bf16"))
    assert rope_.unsupported_reason(RopeCase(1, 4, 1, 8, dtype="bf16",
                                             cos_sin_dtype="same")) is None
    assert "own sine" in rope_.unsupported_reason(
        RopeCase(1, 4, 1, 8, direction="backward", asymmetric=True))
    assert rope_.unsupported_reason(RopeCase(1, 4, 1, 8, direction="backward", asymmetric=True,
                                             style="interleaved")) is None
    assert "contiguous" in rope_.unsupported_reason(RopeCase(1, 4, 1, 8, contiguous=False))
    assert "layout" in rope_.unsupported_reason(RopeCase(1, 4, 1, 8, layout="bhsd"))
    assert "q and k together" in qkv.unsupported_reason(RopeCase(1, 4, 1, 8))
    assert qkv.unsupported_reason(RopeCase(1, 4, 4, 8, kv_heads=1)) is None
    assert "positions" in computed.unsupported_reason(
        RopeCase(1, 4, 1, 8, style="interleaved", positions="ids"))
    assert "asymmetric" in computed.unsupported_reason(
        RopeCase(1, 4, 1, 8, style="interleaved", direction="backward", asymmetric=True))
    # the computed path takes any table dtype: it ignores the tables
    assert computed.unsupported_reason(RopeCase(1, 4, 1, 8, style="interleaved",
                                                dtype="fp16")) is None


def test_angle_tolerance_covers_the_reciprocal_formulation():
    import math

    # ln(base) * 2^-23 (exponent from the fp32-rounded 1/D) + four fp32 roundings, base 1e6
    assert canonical.ANGLE_REL_ERR_PADDLE_V1 > math.log(1e6) * 2**-23 + 4 * 2**-24
