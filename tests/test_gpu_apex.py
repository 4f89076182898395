"""apex's fused RoPE port on the GPU.

Against the float64 oracle (rotate-half): fp32 / fp16 / bf16, d2 in {d, d/2}, both block shapes
(h < 16 and h >= 16), non-contiguous inputs (TE's transposes of (0, 1) and (2, 3)),
``transpose_output_memory`` both ways, backward with the zero-stride gradient of
``out.sum() * 2`` and with a random gradient on tables whose two halves differ, thd with uneven
``cu_seqlens``, 2-D with ``img_h != img_w``. fp16 / bf16 results are compared *bitwise* with a
torch emulation of c10's op-by-op rounding. Every output is poisoned (NaN) first, so an element
the kernel leaves unwritten fails.
"""
from __future__ import annotations

import math

import pytest
import torch

from ports import _alloc, apex
from ports.apex import canonical
from ports.apex import fused_rotary_positional_embedding as ext
from reference.oracle import apply_rope
from reference.tolerances import tolerance

pytestmark = pytest.mark.gpu

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TRANSPOSES = [None, (0, 1), (2, 3)]


# ---- helpers ---------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


def _randn(shape, dtype, seed, transpose=None) -> torch.Tensor:
    """Random values of ``shape``; with ``transpose`` the same logical tensor in other memory
    (``t.transpose(*tr).contiguous().transpose(*tr)``, as apex's and TE's tests build it)."""
    t = torch.randn(shape, generator=_gen(seed), device="cuda").to(dtype)
    if transpose:
        t = t.transpose(*transpose).contiguous().transpose(*transpose)
    return t


def _angles(rows: int, d2: int, seed: int) -> torch.Tensor:
    """Random fp32 angles ``[rows, 1, 1, d2]`` in [0, 60): every element its own angle, so the
    two halves differ (which a backward using the element's own sine would get wrong)."""
    return (torch.rand((rows, 1, 1, d2), generator=_gen(seed), device="cuda") * 60.0).contiguous()


def _check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) elements"
    tol = tolerance(ref, dtype, steps=canonical.APEX_STEPS[_name(dtype)])
    err = (out.double() - ref).abs()
    worst = float((err / tol).max()) if err.numel() else 0.0
    assert worst <= 1.0, f"max err {float(err.max()):.3g} is {worst:.3g}x the tolerance"


def _name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def _oracle_and_grad(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     grad: torch.Tensor | None = None):
    """float64 rotate-half of ``t`` with full-width per-element ``cos``/``sin`` broadcast to
    ``t[..., :d2]``; with ``grad``, also the exact input gradient (by autograd)."""
    x = t.detach().double().requires_grad_(grad is not None)
    y = apply_rope(x, cos.double(), sin.double(), "rotate_half")
    if grad is None:
        return y.detach(), None
    (dx,) = torch.autograd.grad(y, x, grad.double())
    return y.detach(), dx


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


# ---- sbhd: forward ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d2", [64, 32], ids=["d2=d", "d2=d/2"])
@pytest.mark.parametrize("heads", [5, 20], ids=["h<16", "h>=16"])
@pytest.mark.parametrize("cached", [False, True], ids=["freqs", "cached"])
def test_forward_matches_oracle(dtype, d2, heads, cached):
    s, b, d = 37, 3, 64
    dt = DTYPES[dtype]
    t = _randn((s, b, heads, d), dt, seed=heads + d2)
    freqs = _angles(s, d2, seed=1)
    cos, sin = freqs.double().cos(), freqs.double().sin()
    with _alloc.poisoned():
        if cached:
            out = apex.fused_apply_rotary_pos_emb_cached(t, cos.float(), sin.float())
        else:
            out = apex.fused_apply_rotary_pos_emb(t, freqs)
    assert out.shape == t.shape and out.is_contiguous()
    ref, _ = _oracle_and_grad(t, cos, sin)
    _check_close(out, ref, dt)
    assert torch.equal(out[..., d2:], t[..., d2:]), "the tail must be copied bit for bit"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cached_tables_in_the_input_dtype(dtype):
    s, b, h, d = 21, 2, 16, 32
    dt = DTYPES[dtype]
    t = _randn((s, b, h, d), dt, seed=3)
    freqs = _angles(s, d, seed=4)
    cos, sin = freqs.cos().to(dt), freqs.sin().to(dt)
    with _alloc.poisoned():
        out = apex.fused_apply_rotary_pos_emb_cached(t, cos, sin)
    _check_close(out, _oracle_and_grad(t, cos, sin)[0], dt)


@pytest.mark.parametrize("transpose", TRANSPOSES, ids=lambda tr: f"transpose{tr}")
@pytest.mark.parametrize("flag", [False, True], ids=["sbhd_out", "bshd_memory_out"])
@pytest.mark.parametrize("cached", [False, True], ids=["freqs", "cached"])
def test_strided_input_and_output_memory(transpose, flag, cached):
    """Non-contiguous input, both output memory layouts, forward and backward."""
    s, b, h, d, d2 = 19, 3, 16, 64, 32
    dt = torch.bfloat16
    t = _randn((s, b, h, d), dt, seed=5, transpose=transpose).requires_grad_(True)
    freqs = _angles(s, d2, seed=6)
    cos, sin = freqs.double().cos(), freqs.double().sin()
    g = _randn((s, b, h, d), dt, seed=7)
    with _alloc.poisoned():
        if cached:
            out = apex.fused_apply_rotary_pos_emb_cached(t, cos.float(), sin.float(),
                                                         transpose_output_memory=flag)
        else:
            out = apex.fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=flag)
        (grad,) = torch.autograd.grad(out, t, g)  # as the backward returns it (no re-layout)
    assert out.shape == (s, b, h, d)
    assert out.transpose(0, 1).is_contiguous() is flag  # apex's own test asserts this
    assert grad.transpose(0, 1).is_contiguous() is flag  # the backward honours the flag too
    ref, dref = _oracle_and_grad(t, cos, sin, g)
    _check_close(out.detach(), ref, dt)
    _check_close(grad, dref, dt)


def test_hand_checked_four_element_example():
    """d = 4, one token with angles (a, b, a, b): y = (x0 ca - x2 sa, x1 cb - x3 sb,
    x2 ca + x0 sa, x3 cb + x1 sb), the rotate-half convention the registry maps to."""
    a, b = 0.5, 2.0
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], device="cuda").view(1, 1, 1, 4)
    freqs = torch.tensor([a, b, a, b], device="cuda").view(1, 1, 1, 4)
    ca, sa, cb, sb = math.cos(a), math.sin(a), math.cos(b), math.sin(b)
    expect = torch.tensor([1 * ca - 3 * sa, 2 * cb - 4 * sb, 3 * ca + 1 * sa, 4 * cb + 2 * sb],
                          device="cuda")
    for out in (apex.fused_apply_rotary_pos_emb(x, freqs),
                apex.fused_apply_rotary_pos_emb_cached(x, freqs.cos(), freqs.sin())):
        torch.testing.assert_close(out.view(4), expect, rtol=1e-6, atol=1e-6)


# ---- sbhd: backward --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grad", ["broadcast", "random"])
@pytest.mark.parametrize("cached", [False, True], ids=["freqs", "cached"])
@pytest.mark.parametrize("d2", [48, 24], ids=["d2=d", "d2=d/2"])
def test_backward_is_the_exact_transpose(dtype, grad, cached, d2):
    """Tables whose halves differ (random per-element angles): the backward must use each
    partner's sine. ``broadcast`` is ``(out.sum() * 2).backward()``: a zero-stride gradient."""
    s, b, h, d = 23, 2, 9, 48
    dt = DTYPES[dtype]
    t = _randn((s, b, h, d), dt, seed=11, transpose=(0, 1)).requires_grad_(True)
    freqs = _angles(s, d2, seed=12)
    cos, sin = freqs.double().cos(), freqs.double().sin()
    assert not torch.equal(cos[..., : d2 // 2], cos[..., d2 // 2:])
    with _alloc.poisoned():
        if cached:
            out = apex.fused_apply_rotary_pos_emb_cached(t, cos.float(), sin.float())
        else:
            out = apex.fused_apply_rotary_pos_emb(t, freqs)
        if grad == "broadcast":
            (out.sum() * 2).backward()
            g = torch.full_like(out, 2.0)
        else:
            g = _randn(out.shape, dt, seed=13)
            out.backward(g)
    _, dref = _oracle_and_grad(t, cos, sin, g)
    _check_close(t.grad, dref, dt)
    assert torch.equal(t.grad[..., d2:], g[..., d2:])


def test_backward_receives_a_zero_stride_gradient():
    t = _randn((8, 2, 4, 16), torch.float16, seed=14).requires_grad_(True)
    seen = []
    out = apex.fused_apply_rotary_pos_emb(t, _angles(8, 16, seed=15))
    out.register_hook(lambda g: seen.append(g.stride()))
    (out.sum() * 2).backward()
    assert seen and seen[0] == (0, 0, 0, 0)


# ---- bit-exactness of the fp16 / bf16 arithmetic ---------------------------------------------
def _c10_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
              backward: bool = False, single_rounding: bool = False) -> torch.Tensor:
    """c10 Half / BFloat16 semantics, op by op: cos/sin rounded to ``dtype``; every ``*`` and
    ``+`` computed in fp32 on the ``dtype`` values and rounded back (RNE). Forward:
    ``T(T(x*c) + T(rot*s))``, rot = (-x2, x1). Backward: ``T(T(g*c) + T(partner*s'))`` with
    partner = (g2, g1) and s' = (sin2, -sin1): each element uses its partner's sine."""
    c = cos.to(dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if backward:
        s1, s2 = sin[..., :half], sin[..., half:]
        s = torch.cat([s2, -s1], dim=-1).to(dtype)
        other = torch.cat([x2, x1], dim=-1)
    else:
        s = sin.to(dtype)
        other = torch.cat([-x2, x1], dim=-1)
    if single_rounding:  # fp32 math, one rounding at the store (TE >= 1.4, Paddle): not apex
        return (x.float() * c.float() + other.float() * s.float()).to(dtype)
    p1 = (x.float() * c.float()).to(dtype)
    p2 = (other.float() * s.float()).to(dtype)
    return (p1.float() + p2.float()).to(dtype)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("table_dtype", ["fp32", "same"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_cached_is_bit_identical_to_c10_rounding(dtype, table_dtype, direction):
    s, b, h, d, d2 = 29, 3, 17, 80, 64
    dt = DTYPES[dtype]
    x = _randn((s, b, h, d), dt, seed=21, transpose=(2, 3))
    freqs = _angles(s, d2, seed=22)
    tdt = torch.float32 if table_dtype == "fp32" else dt
    cos, sin = freqs.cos().to(tdt), freqs.sin().to(tdt)
    call = ext.forward_cached if direction == "forward" else ext.backward_cached
    out = call(x, cos, sin, False)
    emu = _c10_rope(x[..., :d2], cos, sin, dt, backward=direction == "backward")
    assert torch.equal(_bits(out[..., :d2]), _bits(emu))
    assert torch.equal(_bits(out[..., d2:]), _bits(x[..., d2:]))
    # The comparison can fail: fp32 arithmetic with one rounding differs in some elements.
    once = _c10_rope(x[..., :d2], cos, sin, dt, backward=direction == "backward",
                     single_rounding=True)
    assert not torch.equal(_bits(once), _bits(emu))


def _probe_trig(freqs: torch.Tensor, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 per-element cos / sin the freqs kernel itself computes, read off its fp32
    instantiation with one-hot inputs (``1*c + 0*s`` is exact, so the outputs *are* the values).

    forward (sincosf):  x = (1, 0) -> y = (cos_lo, sin_hi);  x = (0, 1) -> y = (-sin_lo, cos_hi).
    backward (cosf / sinf): g = (1, 0) -> dx = (cos_lo, -sin_lo');  g = (0, 1) -> dx =
    (sin_hi', cos_hi), where ' marks the partner's angle; returned as per-element tables.
    """
    s, _, _, d2 = freqs.shape
    half = d2 // 2
    lo = torch.zeros((s, 1, 1, d2), device="cuda")
    lo[..., :half] = 1.0
    hi = 1.0 - lo
    call = ext.forward if direction == "forward" else ext.backward
    a, b = call(lo, freqs, False), call(hi, freqs, False)
    cos = torch.cat([a[..., :half], b[..., half:]], dim=-1)
    if direction == "forward":
        sin = torch.cat([-b[..., :half], a[..., half:]], dim=-1)
    else:  # sinf of element j: j < half from g = (1, 0) at j + half; j >= half from g = (0, 1)
        sin = torch.cat([-a[..., half:], b[..., :half]], dim=-1)
    return cos, sin


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_freqs_path_is_bit_identical_to_c10_rounding(dtype, direction):
    """With the kernel's own fp32 sin/cos (probed), the fp16/bf16 freqs kernels equal the c10
    emulation bit for bit. (Assumes the fp32 and 16-bit instantiations call the same libdevice
    sincosf / cosf / sinf, which they do: the trig is on fp32 angles in every instantiation.)"""
    s, b, h, d, d2 = 31, 2, 6, 64, 64
    dt = DTYPES[dtype]
    freqs = _angles(s, d2, seed=31)
    cos, sin = _probe_trig(freqs, direction)
    torch.testing.assert_close(cos.double(), freqs.double().cos(), rtol=0, atol=3e-7)
    torch.testing.assert_close(sin.double(), freqs.double().sin(), rtol=0, atol=3e-7)
    x = _randn((s, b, h, d), dt, seed=32)
    call = ext.forward if direction == "forward" else ext.backward
    out = call(x, freqs, False)
    emu = _c10_rope(x, cos, sin, dt, backward=direction == "backward")
    assert torch.equal(_bits(out), _bits(emu))
    once = _c10_rope(x, cos, sin, dt, backward=direction == "backward", single_rounding=True)
    assert not torch.equal(_bits(once), _bits(emu))


# ---- thd -------------------------------------------------------------------------------------
def _thd_reference(t, lengths, start, freqs, grad=None):
    """float64 per-sequence oracle: token k of each sequence uses freqs row k."""
    cos_rows, sin_rows = [], []
    for n in lengths:
        cos_rows.append(freqs[:n].double().cos())
        sin_rows.append(freqs[:n].double().sin())
    cos = torch.cat(cos_rows).view(-1, 1, freqs.shape[-1])
    sin = torch.cat(sin_rows).view(-1, 1, freqs.shape[-1])
    end = start + sum(lengths)
    grad_part = None if grad is None else grad[start:end]
    return _oracle_and_grad(t[start:end], cos, sin, grad_part)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,d,d2,transpose", [(4, 64, 64, None), (16, 64, 32, (1, 2))],
                         ids=["h<16,d2=d", "h>=16,d2=d/2,strided"])
def test_thd_uneven_sequences(dtype, heads, d, d2, transpose):
    dt = DTYPES[dtype]
    lengths = [7, 1, 30, 12, 1, 25]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    total, max_s = sum(lengths), 32
    t = _randn((total, heads, d), dt, seed=41, transpose=transpose).requires_grad_(True)
    freqs = _angles(max_s, d2, seed=42)
    g = _randn((total, heads, d), dt, seed=43)
    with _alloc.poisoned():
        out = apex.fused_apply_rotary_pos_emb_thd(t, cu, freqs)
        out.backward(g)
    assert out.shape == (total, heads, d) and out.is_contiguous()
    ref, dref = _thd_reference(t, lengths, 0, freqs, g)
    _check_close(out.detach(), ref, dt)
    _check_close(t.grad, dref, dt)


def test_thd_broadcast_gradient_and_uncovered_rows_are_zero():
    """cu_seqlens covering only rows [3, 3 + 14) of 20: the rest is zero-filled (apex leaves it
    uninitialised), forward and backward."""
    lengths, start, total, max_s = [9, 1, 4], 3, 20, 10
    cu = torch.tensor([start, start + 9, start + 10, start + 14], dtype=torch.int32, device="cuda")
    t = _randn((total, 3, 32), torch.float32, seed=44).requires_grad_(True)
    freqs = _angles(max_s, 32, seed=45)
    with _alloc.poisoned():
        out = apex.fused_apply_rotary_pos_emb_thd(t, cu, freqs)
        (out.sum() * 2).backward()
    end = start + sum(lengths)
    for x in (out.detach(), t.grad):
        assert (x[:start] == 0).all() and (x[end:] == 0).all()
    ref, dref = _thd_reference(t, lengths, start, freqs, torch.full_like(t, 2.0))
    _check_close(out.detach()[start:end], ref, torch.float32)
    _check_close(t.grad[start:end], dref, torch.float32)


@pytest.mark.parametrize("cu,match", [
    ([0, 5, 3, 8], "non-decreasing"),
    ([0, 4, 9], "exceeds the 8 packed tokens"),
    ([0, 7, 8], "max_s = 6"),
    ([-1, 4, 8], ">= 0"),
])
def test_thd_bad_cu_seqlens_raise(cu, match):
    t = torch.randn(8, 2, 16, device="cuda")
    freqs = _angles(6, 16, seed=46)
    with pytest.raises(ValueError, match=match):
        apex.fused_apply_rotary_pos_emb_thd(t, torch.tensor(cu, dtype=torch.int32, device="cuda"),
                                            freqs)
    with pytest.raises(TypeError, match="int32"):
        apex.fused_apply_rotary_pos_emb_thd(t, torch.tensor([0, 8], device="cuda"), freqs)


# ---- 2-D -------------------------------------------------------------------------------------
def _reference_2d(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w, grad=None):
    """float64 2-D RoPE (apex's test's unfused version, in float64): channels [0, d/2) a
    rotate-half with (cos_h, sin_h) row ih, channels [d/2, d) with (cos_w, sin_w) row iw."""
    b, _, h, d = t.shape
    x = t.detach().double().requires_grad_(grad is not None)
    q = x.view(b, img_h, img_w, h, d)
    q1, q2 = q.chunk(2, dim=-1)
    ch = cos_h.double()[:, :img_h].unsqueeze(2)  # [1, img_h, 1, 1, d/2]
    sh = sin_h.double()[:, :img_h].unsqueeze(2)
    cw = cos_w.double()[:, :img_w].unsqueeze(1)  # [1, 1, img_w, 1, d/2]
    sw = sin_w.double()[:, :img_w].unsqueeze(1)
    y = torch.cat([apply_rope(q1, ch, sh, "rotate_half"), apply_rope(q2, cw, sw, "rotate_half")],
                  dim=-1).reshape(b, img_h * img_w, h, d)
    if grad is None:
        return y.detach(), None
    (dx,) = torch.autograd.grad(y, x, grad.double())
    return y.detach(), dx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("img_h,img_w,margin", [(3, 5, 0), (4, 2, 3)])
@pytest.mark.parametrize("table_dtype", ["fp32", "same"])
@pytest.mark.parametrize("transpose", TRANSPOSES, ids=lambda tr: f"transpose{tr}")
def test_2d_rows_and_columns(dtype, img_h, img_w, margin, table_dtype, transpose):
    b, h, d = 2, 18 if transpose else 6, 32
    dt = DTYPES[dtype]
    tdt = torch.float32 if table_dtype == "fp32" else dt
    t = _randn((b, img_h * img_w, h, d), dt, seed=51, transpose=transpose).requires_grad_(True)
    emb_h = _angles(img_h + margin, d // 2, seed=52).view(1, img_h + margin, 1, d // 2)
    emb_w = _angles(img_w + margin, d // 2, seed=53).view(1, img_w + margin, 1, d // 2)
    cos_h, sin_h = emb_h.cos().to(tdt), emb_h.sin().to(tdt)
    cos_w, sin_w = emb_w.cos().to(tdt), emb_w.sin().to(tdt)
    g = _randn(t.shape, dt, seed=54)
    with _alloc.poisoned():
        out = apex.fused_apply_rotary_pos_emb_2d(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w)
        out.backward(g)
    assert out.shape == t.shape and out.is_contiguous()
    ref, dref = _reference_2d(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w, g)
    _check_close(out.detach(), ref, dt)
    _check_close(t.grad, dref, dt)


def test_2d_broadcast_gradient():
    t = _randn((1, 6, 4, 16), torch.float16, seed=55).requires_grad_(True)
    emb = _angles(3, 8, seed=56).view(1, 3, 1, 8)
    out = apex.fused_apply_rotary_pos_emb_2d(t, 2, 3, emb.cos(), emb.sin(), emb.cos(), emb.sin())
    (out.sum() * 2).backward()
    g = torch.full_like(t, 2.0)
    _, dref = _reference_2d(t, 2, 3, emb.cos(), emb.sin(), emb.cos(), emb.sin(), g)
    _check_close(t.grad, dref, torch.float16)


# ---- bad inputs on the GPU, launch details -------------------------------------------------------
def test_bad_inputs_raise_on_the_gpu():
    t = torch.randn(4, 2, 3, 16, device="cuda")
    f = _angles(4, 16, seed=61)
    with pytest.raises(TypeError, match="not supported for 'Float' with 'Half'"):
        apex.fused_apply_rotary_pos_emb_cached(t, f.cos().half(), f.sin().half())
    with pytest.raises(TypeError, match="not implemented for 'Double'"):
        apex.fused_apply_rotary_pos_emb(t.double(), f)
    with pytest.raises(ValueError, match="contiguous"):
        apex.fused_apply_rotary_pos_emb(t, torch.cat([f, f], -1)[..., ::2])
    with pytest.raises(ValueError, match="multiple of 2"):
        apex.fused_apply_rotary_pos_emb(t, f[..., :15].contiguous())
    with pytest.raises(ValueError, match="CUDA"):
        apex.fused_apply_rotary_pos_emb(t, f.cpu())
    with pytest.raises(NotImplementedError, match="grid"):
        apex.fused_apply_rotary_pos_emb(torch.empty(1, 65536, 1, 2, device="cuda"),
                                        _angles(1, 2, seed=62))
    with pytest.raises(ValueError, match="multiple of 4"):
        e = _angles(2, 3, seed=63).view(1, 2, 1, 3)
        apex.fused_apply_rotary_pos_emb_2d(torch.randn(1, 4, 1, 6, device="cuda"), 2, 2,
                                           e, e, e, e)


def test_refuses_offsets_past_int32():
    big = torch.empty(2**31 + 16, dtype=torch.float16, device="cuda")
    t = big.as_strided((2, 1, 1, 16), (2**31, 16, 16, 1))
    with pytest.raises(NotImplementedError, match="int32|32-bit"):
        apex.fused_apply_rotary_pos_emb(t, _angles(2, 16, seed=64))


def test_empty_input_returns_empty_without_a_launch():
    t = torch.empty(0, 2, 3, 8, device="cuda")
    out = apex.fused_apply_rotary_pos_emb(t, torch.empty(0, 1, 1, 8, device="cuda"))
    assert out.shape == t.shape


def test_block_shape_follows_the_head_count():
    assert ext._block(15) == (32, 4) and ext._block(16) == (32, 8)


def test_launches_on_torch_current_stream():
    t = torch.randn(512, 4, 8, 128, device="cuda")
    fresh = torch.randn_like(t)
    freqs = _angles(512, 128, seed=65)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # anything launched on another stream would run first
        t.copy_(fresh)
        out = apex.fused_apply_rotary_pos_emb(t, freqs)
    side.synchronize()
    assert torch.equal(out, apex.fused_apply_rotary_pos_emb(fresh, freqs))
