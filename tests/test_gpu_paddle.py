"""Paddle V1 port on the GPU: the naming trap by hand, both conventions against the float64 oracle,
given and computed sin/cos, position_ids, 1-3 tensors and GQA, backward through autograd, and
the host guards on CUDA tensors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ports import _alloc, paddle
from ports.paddle.canonical import ANGLE_REL_ERR_PADDLE_V1
from reference.case import DTYPES, RopeCase, make_inputs
from reference.expected import expected, tolerances
from reference.oracle import rotate
from reference.tolerances import DEFAULT_STEPS

pytestmark = pytest.mark.gpu

rope = paddle.fused_rotary_position_embedding
STYLE = {True: "interleaved", False: "rotate_half"}  # use_neox_rotary_style -> convention


# ---- the naming trap, by hand --------------------------------------------------------------------
# x = [1, 2, 3, 4] at position 0; per-element tables (one row).
# Table A: cos = [0, 0, 1, 1], sin = [1, 1, 0, 0] (interleaved layout: pair (0,1) at 90 degrees,
#   pair (2,3) at 0): interleaved y = [0*1 - 1*2, 1*1 + 0*2, 3, 4] = [-2, 1, 3, 4].
# Table B: cos = [0, 1, 0, 1], sin = [1, 0, 1, 0] (concatenated layout: pair (0,2) at 90 degrees,
#   pair (1,3) at 0): rotate-half y = [0*1 - 1*3, 2 - 0*4, 0*3 + 1*1, 4] = [-3, 2, 1, 4].
#   The same table read as interleaved: [0*1 - 1*2, 0*1 + 1*2, 0*3 - 1*4, 0*3 + 1*4]
#   = [-2, 2, -4, 4].
HAND = [
    # (use_neox_rotary_style, cos, sin, expected)
    (True, [0, 0, 1, 1], [1, 1, 0, 0], [-2, 1, 3, 4]),
    (True, [0, 1, 0, 1], [1, 0, 1, 0], [-2, 2, -4, 4]),
    (False, [0, 1, 0, 1], [1, 0, 1, 0], [-3, 2, 1, 4]),
]


@pytest.mark.parametrize("flag,cos,sin,want", HAND)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_use_neox_rotary_style_true_means_interleaved(flag, cos, sin, want, dtype):
    dev = "cuda"
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], device=dev, dtype=dtype).view(1, 1, 1, 4)
    c = torch.tensor([cos], device=dev, dtype=dtype)
    s = torch.tensor([sin], device=dev, dtype=dtype)
    out, _, _ = rope(x, sin=s, cos=c, use_neox_rotary_style=flag)  # note: sin before cos
    torch.cuda.synchronize()
    assert out.flatten().tolist() == want


# ---- against the float64 oracle ------------------------------------------------------------------
def _check(style, dtype, layout, *, heads=(4,), positions="arange", source="tables",
           base=10000.0, b=2, s=12, d=32, direction="forward", asymmetric=False, seed=0,
           grad="random"):
    """Run the port on fresh inputs (outputs NaN-poisoned) and compare with the oracle."""
    case = RopeCase(b, s, heads[0], d, layout=layout, dtype=dtype, style=style,
                    positions=positions, base=base, cos_sin_dtype="same", direction=direction,
                    asymmetric=asymmetric, grad=grad)
    inputs = make_inputs(case, seed=seed, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    xs = tuple(torch.randn(case.shape(h), generator=gen, device="cuda").to(case.torch_dtype)
               for h in heads)
    grads = None
    if direction == "backward":
        if grad == "broadcast":
            grads = tuple(torch.full((), 2.0, dtype=case.torch_dtype, device="cuda")
                          .expand(x.shape) for x in xs)
        else:
            grads = tuple(torch.randn(x.shape, generator=gen, device="cuda")
                          .to(case.torch_dtype) for x in xs)
    inputs = dataclasses.replace(inputs, xs=xs, grads=grads)
    if source == "tables":
        if positions == "arange":
            sin, cos, ids = inputs.sin[:s].contiguous(), inputs.cos[:s].contiguous(), None
        else:
            sin, cos, ids = inputs.sin, inputs.cos, inputs.positions
        if positions == "arange" and layout == "sbhd":  # also exercise the [1, S, 1, D] form
            sin, cos = sin.view(1, s, 1, d), cos.view(1, s, 1, d)
    else:
        sin = cos = ids = None
    kwargs = dict(sin=sin, cos=cos, position_ids=ids, use_neox_rotary_style=style == "interleaved",
                  time_major=layout == "sbhd", rotary_emb_base=base)
    padded = list(xs) + [None] * (3 - len(xs))
    with _alloc.poisoned():
        if direction == "forward":
            outs = [o for o in rope(*padded, **kwargs) if o is not None]
        else:
            leaves = [x.detach().requires_grad_(True) for x in xs]
            outs_f = [o for o in rope(*leaves, *[None] * (3 - len(xs)), **kwargs)
                      if o is not None]
            outs = list(torch.autograd.grad(outs_f, leaves, grads))
    torch.cuda.synchronize()
    refs = expected(case, inputs, source)
    angle_err = ANGLE_REL_ERR_PADDLE_V1 if source == "computed" else 0.0
    tols = tolerances(case, inputs, refs, steps=DEFAULT_STEPS[dtype], angle_rel_err=angle_err)
    assert len(outs) == len(xs)
    for i, (out, ref, tol, x) in enumerate(zip(outs, refs, tols, xs)):
        assert out.shape == x.shape and out.dtype == x.dtype
        assert not torch.isnan(out).any(), f"tensor {i}: unwritten (NaN-poisoned) elements"
        err = (out.double() - ref).abs()
        assert (err <= tol).all(), (f"tensor {i}: max err {float(err.max()):.3g}, worst "
                                    f"err/tol {float((err / tol).max()):.3g}")
    return outs


STYLES = ["interleaved", "rotate_half"]
LAYOUTS = ["bshd", "sbhd"]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_given_tables_match_oracle(style, dtype, layout):
    _check(style, dtype, layout)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("positions", ["ids", "offset"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_position_ids_per_row(style, positions, layout):
    _check(style, "fp32", layout, positions=positions, seed=3)
    _check(style, "bf16", layout, positions=positions, seed=4)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_given_tables_default_and_other_base_branch(style, base):
    # With tables the base only picks the kernel branch; rotate-half's other branch has no
    # grid-stride loop upstream. Odd sizes so the last block is partly idle.
    _check(style, "fp32", "bshd", base=base, b=3, s=37, heads=(5,), d=24, seed=5)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_computed_sin_cos_match_oracle(dtype, layout, base):
    _check("interleaved", dtype, layout, source="computed", base=base, s=300, seed=6)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("heads", [(4,), (4, 4), (4, 4, 4)], ids=["q", "qk", "qkv"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_to_three_tensors_with_equal_heads(style, heads, layout):
    _check(style, "fp16", layout, heads=heads, positions="ids", seed=7)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("heads", [(8, 2), (8, 2, 2), (6, 1, 1), (6, 3)],
                         ids=["gqa-k", "gqa-kv", "mqa-kv", "gqa-6-3"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("base", [10000.0, 20000.0])
def test_gqa_two_launches(style, heads, layout, base):
    _check(style, "fp32", layout, heads=heads, base=base, seed=8)


def test_gqa_computed():
    _check("interleaved", "bf16", "sbhd", heads=(8, 2, 2), source="computed", seed=9)


def test_q_k_v_take_one_launch_and_gqa_two(monkeypatch):
    from ports import _cupy

    real, count = _cupy.launch, []

    def counting(*args, **kwargs):
        count.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(_cupy, "launch", counting)
    q = torch.randn(2, 8, 4, 16, device="cuda")
    rope(q, q.clone(), q.clone())
    assert len(count) == 1
    rope(q, torch.randn(2, 8, 2, 16, device="cuda"), torch.randn(2, 8, 2, 16, device="cuda"))
    assert len(count) == 3


# ---- backward through autograd -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backward_every_two_is_exact_with_asymmetric_tables(dtype, layout):
    # cos/sin whose pair members differ (Paddle#74716 hid behind identical halves)
    _check("interleaved", dtype, layout, direction="backward", asymmetric=True,
           heads=(4, 4, 4), positions="ids", seed=10)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backward_rotate_half_with_concatenated_tables(dtype, layout):
    _check("rotate_half", dtype, layout, direction="backward", heads=(4, 4), seed=11)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("heads", [(8, 2, 2), (4,)], ids=["gqa", "q"])
def test_backward_gqa_broadcast_grad_and_other_base(style, heads):
    _check(style, "bf16", "bshd", direction="backward", heads=heads, grad="broadcast",
           base=20000.0, seed=12)
    _check(style, "fp32", "sbhd", direction="backward", heads=heads, positions="ids", seed=13)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_backward_computed(layout):
    _check("interleaved", "fp32", layout, direction="backward", source="computed",
           heads=(4, 2), base=500000.0, seed=14)


def test_rotate_half_backward_uses_own_sine_with_asymmetric_tables():
    """Upstream numerics, kept: dx = g*cos - rotate_half(g)*sin with each element's own sine;
    the exact transpose uses the partner's. They differ when the two halves differ."""
    case = RopeCase(1, 6, 2, 8, style="rotate_half", asymmetric=True, dtype="fp64",
                    cos_sin_dtype="same")
    inputs = make_inputs(case, seed=15, device="cuda")
    x = inputs.x.detach().requires_grad_(True)
    out, _, _ = rope(x, sin=inputs.sin, cos=inputs.cos, use_neox_rotary_style=False)
    g = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, g)
    cos, sin = inputs.cos[:, None, :], inputs.sin[:, None, :]  # [S, 1, D] against [1, S, H, D]
    own_sine = g * cos - rotate(g, "rotate_half") * sin
    torch.testing.assert_close(dx, own_sine, rtol=1e-12, atol=1e-12)
    exact = expected(case.replace(direction="backward"),
                     dataclasses.replace(inputs, grads=(g,)), "tables")[0]
    assert not torch.allclose(dx, exact)


# ---- guards and edge cases on CUDA tensors -------------------------------------------------------
def test_host_guards_raise_on_cuda_tensors():
    dev = "cuda"
    q = torch.randn(2, 8, 4, 16, device=dev)
    sin, cos = torch.rand(8, 16, device=dev), torch.rand(8, 16, device=dev)
    with pytest.raises(ValueError, match="must match q's"):  # Paddle#74347: k batch < q batch
        rope(q, torch.randn(1, 8, 4, 16, device=dev))
    with pytest.raises(ValueError, match="0 heads"):  # Paddle#78428
        rope(q, torch.randn(2, 8, 0, 16, device=dev))
    ids = torch.zeros(2, 8, dtype=torch.int64, device=dev)
    ids[0, 0] = 8
    with pytest.raises(ValueError, match="read out of bounds"):
        rope(q, sin=sin, cos=cos, position_ids=ids)
    with pytest.raises(NotImplementedError, match="head_dim % 4"):
        q6 = torch.randn(1, 8, 1, 6, device=dev)
        rope(q6, sin=sin[:, :6].contiguous(), cos=cos[:, :6].contiguous(),
             use_neox_rotary_style=False)
    with pytest.raises(NotImplementedError, match="rotate_half without sin/cos"):
        rope(q, use_neox_rotary_style=False)
    with pytest.raises(ValueError, match="must be contiguous"):
        rope(q.transpose(0, 1))
    with pytest.raises(ValueError, match="sin must be a CUDA tensor"):
        rope(q, sin=sin.cpu(), cos=cos.cpu())


def test_every_element_written_and_inputs_unchanged():
    q = torch.randn(3, 5, 7, 12, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    before = (q.clone(), k.clone())
    with _alloc.poisoned():
        out_q, out_k, out_v = rope(q, k)
    torch.cuda.synchronize()
    assert out_v is None
    assert not torch.isnan(out_q).any() and not torch.isnan(out_k).any()
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_empty_q():
    q = torch.empty(0, 4, 2, 8, device="cuda")
    out_q, _, _ = rope(q)
    assert out_q.shape == q.shape


def test_device_limits_read_the_sm_count():
    props = torch.cuda.get_device_properties(0)
    assert paddle._launch.device_limits(0) == (props.multi_processor_count,
                                               props.max_threads_per_block)
