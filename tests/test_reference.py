"""The float64 oracle, the table builders and the canonical case, checked against each other."""
from __future__ import annotations

import math

import pytest
import torch

from reference import eager
from reference.case import RopeCase, make_inputs
from reference.expected import expected, oracle_tables
from reference.oracle import apply_rope, gather_tables, rope_oracle, rope_oracle_backward
from reference.tables import cos_sin, expand_half, first_members, inv_freq, rope_tables
from reference.vocabulary import STYLES


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


# ---- hand-checked 4-element examples ---------------------------------------------------------
# x = [1, 2, 3, 4]; pair 0 rotated by 90 degrees (cos 0, sin 1), pair 1 by 0 degrees.
X4 = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
PAIR_ANGLES = torch.tensor([math.pi / 2, 0.0], dtype=torch.float64)


def test_rotate_half_by_hand():
    # pairs (0, 2) and (1, 3): y0 = x0*0 - x2*1 = -3, y2 = x2*0 + x0*1 = 1; pair (1, 3) unmoved.
    cos, sin = cos_sin(PAIR_ANGLES, "rotate_half", torch.float64)
    y = apply_rope(X4, cos, sin, "rotate_half")
    torch.testing.assert_close(y, torch.tensor([-3.0, 2.0, 1.0, 4.0], dtype=torch.float64),
                               atol=1e-15, rtol=0)


def test_interleaved_by_hand():
    # pairs (0, 1) and (2, 3): y0 = x0*0 - x1*1 = -2, y1 = x1*0 + x0*1 = 1; pair (2, 3) unmoved.
    cos, sin = cos_sin(PAIR_ANGLES, "interleaved", torch.float64)
    y = apply_rope(X4, cos, sin, "interleaved")
    torch.testing.assert_close(y, torch.tensor([-2.0, 1.0, 3.0, 4.0], dtype=torch.float64),
                               atol=1e-15, rtol=0)


# ---- tables -----------------------------------------------------------------------------------
def test_inv_freq_values():
    torch.testing.assert_close(inv_freq(4, 10000.0), torch.tensor([1.0, 0.01], dtype=torch.float64))
    with pytest.raises(ValueError, match="even"):
        inv_freq(5)


def test_table_layouts():
    cos, _ = rope_tables(3, 8, style="rotate_half", dtype=torch.float64)
    torch.testing.assert_close(cos[:, :4], cos[:, 4:])  # concatenated
    cos_i, _ = rope_tables(3, 8, style="interleaved", dtype=torch.float64)
    torch.testing.assert_close(cos_i[:, 0::2], cos_i[:, 1::2])  # duplicated
    torch.testing.assert_close(first_members(cos, "rotate_half"), first_members(cos_i, "interleaved"))
    assert cos.dtype == torch.float64 and cos.shape == (3, 8)


# ---- self-consistency ------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
def test_interleaved_is_rotate_half_under_channel_permutation(layout):
    case = RopeCase(2, 7, 3, 16, layout=layout, style="interleaved", positions="ids")
    inp = make_inputs(case, seed=1)
    y_inter = expected(case, inp)[0]
    # Interleaved pair (2i, 2i+1) is rotate-half pair (i, i + R/2) after this permutation.
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])
    cos_h = expand_half(first_members(inp.cos, "interleaved"), "rotate_half")
    sin_h = expand_half(first_members(inp.sin, "interleaved"), "rotate_half")
    y_half = rope_oracle(inp.x[..., perm], cos_h, sin_h, inp.positions, layout=layout,
                         style="rotate_half")
    inverse = torch.argsort(perm)
    torch.testing.assert_close(y_half[..., inverse], y_inter, atol=0, rtol=0)


def test_complex_form_equals_interleaved():
    case = RopeCase(2, 9, 3, 16, style="interleaved", dtype="fp64", cos_sin_dtype="fp64")
    inp = make_inputs(case, seed=2)
    x = inp.x
    rot = torch.polar(torch.ones_like(inp.angles), inp.angles)[: case.seqlen]  # [S, R/2]
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    y_complex = torch.view_as_real(z * rot[None, :, None, :]).flatten(-2)
    torch.testing.assert_close(y_complex, expected(case, inp)[0], atol=1e-13, rtol=0)


@pytest.mark.parametrize("style", STYLES)
def test_backward_is_rotation_by_negative_angle(style):
    case = RopeCase(2, 11, 3, 32, style=style, direction="backward", positions="offset",
                    dtype="fp64", cos_sin_dtype="fp64")
    inp = make_inputs(case, seed=3)
    dx = rope_oracle_backward(inp.x, inp.grads[0], inp.cos, inp.sin, inp.positions,
                              layout=case.layout, style=style)
    rotated_back = rope_oracle(inp.grads[0], inp.cos, -inp.sin, inp.positions,
                               layout=case.layout, style=style)
    torch.testing.assert_close(dx, rotated_back, atol=1e-13, rtol=0)


def test_backward_uses_partner_sine_with_asymmetric_tables():
    # With halves that differ, "rotate by -sin of the element itself" (Paddle#74716) is wrong.
    case = RopeCase(1, 5, 2, 8, direction="backward", asymmetric=True, dtype="fp64",
                    cos_sin_dtype="fp64")
    inp = make_inputs(case, seed=4)
    exact = expected(case, inp)[0]
    own_sine = rope_oracle(inp.grads[0], inp.cos, -inp.sin, inp.positions, layout="bshd",
                           style="rotate_half")
    assert (exact - own_sine).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_partial_rotary_tail_is_bit_exact(dtype):
    case = RopeCase(2, 6, 3, 32, rotary_dim=8, dtype=dtype)
    inp = make_inputs(case, seed=5)
    y = expected(case, inp)[0]
    assert torch.equal(y[..., 8:], inp.x[..., 8:].to(torch.float64))
    cos, sin = gather_tables(inp.cos, inp.sin, inp.positions, "bshd")
    q = inp.x
    y_hf = torch.cat([eager.hf_apply_rotary_pos_emb(q[..., :8], None, cos[:, :, 0].to(q.dtype),
                                                     sin[:, :, 0].to(q.dtype), 2)[0], q[..., 8:]], -1)
    assert torch.equal(y_hf[..., 8:], q[..., 8:])


def test_positions_outside_table_raise():
    cos, sin = rope_tables(4, 8)
    with pytest.raises(IndexError, match="table has 4 rows"):
        gather_tables(cos, sin, torch.tensor([[0, 4]]), "bshd")


def test_oracle_rejects_mismatched_tables():
    with pytest.raises(ValueError, match="differ in shape"):
        apply_rope(_rand(2, 8), _rand(2, 8), _rand(2, 6), "rotate_half")
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rope(_rand(2, 8), _rand(2, 10), _rand(2, 10), "rotate_half")


# ---- the canonical case -----------------------------------------------------------------------
def test_case_validation():
    with pytest.raises(ValueError, match="rotary_dim"):
        RopeCase(1, 4, 1, 8, rotary_dim=10)
    with pytest.raises(ValueError, match="rotary_dim"):
        RopeCase(1, 4, 1, 7)  # odd head_dim
    with pytest.raises(ValueError, match="seqlens"):
        RopeCase(2, 4, 1, 8, layout="thd")
    with pytest.raises(ValueError, match="unknown layout"):
        RopeCase(1, 4, 1, 8, layout="bsd")
    with pytest.raises(ValueError, match="positive"):
        RopeCase(0, 4, 1, 8)


def test_inputs_are_fresh_random_and_nonzero():
    case = RopeCase(2, 8, 3, 16, positions="ids")
    a, b = make_inputs(case, seed=0), make_inputs(case, seed=1)
    assert not torch.equal(a.x, b.x) and not torch.equal(a.positions, b.positions)
    assert (a.x != 0).float().mean() > 0.99
    assert torch.equal(a.x, make_inputs(case, seed=0).x)  # reproducible from the seed
    # ids differ per batch row
    assert not torch.equal(a.positions[0], a.positions[1])


def test_strided_and_broadcast_inputs():
    case = RopeCase(2, 8, 3, 16, contiguous=False, direction="backward", grad="broadcast")
    inp = make_inputs(case, seed=0)
    assert not inp.x.is_contiguous() and inp.x.stride(-1) == 1
    assert inp.grads[0].stride() == (0, 0, 0, 0) and float(inp.grads[0][0, 0, 0, 0]) == 2.0


def test_thd_positions_restart_per_sequence():
    case = RopeCase(3, 5, 2, 8, layout="thd", seqlens=(5, 1, 3))
    inp = make_inputs(case)
    assert inp.cu_seqlens.tolist() == [0, 5, 6, 9] and inp.cu_seqlens.dtype == torch.int32
    assert inp.positions.tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2]
    assert inp.x.shape == (9, 2, 8)


def test_io_bytes_counts_read_and_write_of_each_tensor():
    case = RopeCase(2, 4, 3, 8, dtype="bf16", kv_heads=1)
    assert case.io_bytes() == 2 * (2 * 4 * 3 * 8 * 2) + 2 * (2 * 4 * 1 * 8 * 2)


def test_oracle_table_sources():
    case = RopeCase(1, 300, 1, 8, dtype="fp32")
    inp = make_inputs(case)
    given, _ = oracle_tables(case, inp, "tables")
    ideal, _ = oracle_tables(case, inp, "computed")
    rounded, _ = oracle_tables(case, inp, "angles32")
    assert given.dtype == ideal.dtype == torch.float64
    assert 0 < (given - ideal).abs().max() < 1e-7      # fp32 table rounding only
    assert 0 < (rounded - ideal).abs().max() < 1e-4     # fp32 angle rounding grows with position
