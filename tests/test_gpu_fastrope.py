"""fastrope, the package's kernel (ports/fastrope), on the GPU.

* Cross-validation through the harness (``run_case``: outputs NaN-poisoned, compared with the
  float64 oracle of what each spec consumed, inputs checked unchanged) of the three fastrope specs
  over the smoke, crossval, decode, partial, positions, varlen, gqa, interleaved and qkv suites
  (big cases shrunk) and a list of cases aimed at the design's edges: q/k cut from a packed qkv
  in every layout, GQA/MQA, odd sizes, partial rotary, per-row ids, uneven thd, both styles,
  every dtype, asymmetric tables and broadcast gradients in backward.
* One case of more than 2^31 elements (64-bit offsets).
* Direct API properties: in-place determinism and agreement with the out-of-place call, inputs
  left unchanged, every output written, a bit-exact pass-through tail, accuracy within one ulp at
  positions up to 128k, autograd (out of place and in place), equivalent position forms, and
  errors raised on the host that leave the CUDA context usable.

Every test here is marked ``gpu`` and is skipped on machines without one.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import zlib

import pytest
import torch

from ports import _alloc, registry
from ports.harness.runner import run_case
from ports.harness.suites import get_suite
from ports.fastrope import ablation, apply_rope, apply_rope_inplace, kernel, plan, tuning
from ports.fastrope.canonical import ANGLE_REL_ERR_FP64
from reference.case import RopeCase, RopeInputs, make_inputs
from reference.expected import expected, tolerances
from reference.tables import first_members
from reference.tolerances import DEFAULT_STEPS, ulp
from reference.vocabulary import DTYPES

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
STYLES = ("rotate_half", "interleaved")
FASTROPE = registry.select(["fastrope"])
CUDA = frozenset({"cuda"})
_HEAD_AXIS = {"sbhd": 2, "bshd": 2, "bhsd": 1, "thd": 1}


# ---- helpers -------------------------------------------------------------------------------------
def _seed(case: RopeCase) -> int:
    """A seed that is stable across runs (``hash`` of a str is salted per process)."""
    return zlib.crc32(repr(case).encode()) % 10_000


def _tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t (a bitwise comparison tells -0.0 from 0.0 and NaN payloads apart)."""
    if not t.is_floating_point():
        return t
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _copy_like(x: torch.Tensor) -> torch.Tensor:
    """A copy of x with x's strides (a view of a cloned packed base when x is one)."""
    if x._base is None:
        return x.clone()
    base = x._base.clone()
    return base.as_strided(x.shape, x.stride(), x.storage_offset())


def _kwargs(case: RopeCase, inputs: RopeInputs, computed: bool = False, **extra) -> dict:
    """apply_rope keyword arguments for a case (position checks on, as a caller would)."""
    kw = dict(style=case.style, layout=case.layout, rotary_dim=case.rotary_dim)
    if computed:
        kw.update(base=case.base)
    else:
        kw.update(cos=inputs.cos, sin=inputs.sin)
    if case.layout == "thd":
        kw.update(cu_seqlens=inputs.cu_seqlens)
    if case.positions == "offset":
        kw.update(offsets=inputs.offsets)
    elif case.positions == "ids":
        kw.update(positions=inputs.positions)
    kw.update(extra)
    return kw


def _assert_matches_oracle(case, inputs, outs, source="tables", what="output"):
    """Each of outs within the harness tolerance of the float64 oracle, and fully written."""
    angle = ANGLE_REL_ERR_FP64 if source == "computed" else 0.0
    refs = expected(case, inputs, source)
    tols = tolerances(case, inputs, refs, steps=DEFAULT_STEPS[case.dtype], angle_rel_err=angle)
    assert len(outs) == len(refs)
    for i, (out, ref, tol) in enumerate(zip(outs, refs, tols)):
        assert out.shape == ref.shape and out.dtype == case.torch_dtype, (i, out.shape, out.dtype)
        assert not torch.isnan(out).any(), f"{what} {i}: NaN (unwritten) elements"
        err = (out.double() - ref).abs()
        assert (err <= tol).all(), (f"{what} {i} of {case.describe()}: max err "
                                    f"{float(err.max()):.3g}, worst err/tol "
                                    f"{float((err / tol).max()):.3g}")


def _to(inputs: RopeInputs, device) -> RopeInputs:
    def move(v):
        if v is None:
            return None
        if isinstance(v, tuple):
            return tuple(t.to(device) for t in v)
        return v.to(device)

    return RopeInputs(**{f.name: move(getattr(inputs, f.name))
                         for f in dataclasses.fields(RopeInputs)})


# ---- cross-validation through the harness --------------------------------------------------------
MAX_ELEMENTS = 1 << 21
CROSSVAL_SUITES = ("smoke", "crossval", "decode", "partial", "positions", "varlen", "gqa",
                   "interleaved", "qkv")


def small(case: RopeCase) -> RopeCase:
    """The case at a size that validates in milliseconds: batch <= 2 and seqlen <= 64 (thd: each
    length divided by 64, at least 1, so uneven lengths and length-1 sequences stay); every other
    field (heads, head_dim, dtype, positions, table length...) kept."""
    if case.numel <= MAX_ELEMENTS:
        return case
    label = f"{case.label} (small)"
    if case.layout == "thd":
        lengths = tuple(max(1, n // 64) for n in case.seqlens)
        return case.replace(seqlen=max(lengths), seqlens=lengths, label=label)
    return case.replace(batch=min(case.batch, 2), seqlen=min(case.seqlen, 64), label=label)


def _styles(*cases: RopeCase) -> list[RopeCase]:
    return [c.replace(style=s) for c in cases for s in STYLES]


THD = dict(layout="thd", seqlens=(64, 1, 17, 30))
EDGE_CASES = [
    # q and k cut from a packed qkv (strided tokens and heads), every layout
    *_styles(*[RopeCase(2, 33, 6, 64, layout=layout, dtype="bf16", contiguous=False, kv_heads=2,
                        label="packed qkv") for layout in ("bshd", "sbhd", "bhsd")],
             RopeCase(2, 33, 6, 64, layout="thd", seqlens=(33, 17), dtype="bf16",
                      contiguous=False, kv_heads=2, label="packed qkv"),
             RopeCase(3, 61, 7, 92, layout="sbhd", contiguous=False, kv_heads=3,
                      label="packed qkv, odd sizes")),
    # GQA and MQA: k with fewer heads, one launch
    *_styles(*[RopeCase(2, 48, 32, 128, dtype=dt, kv_heads=kv, label=f"kv_heads={kv}")
               for kv in (8, 1) for dt in ("bf16", "fp32")]),
    # odd sizes, partial rotary with a tail that is not a multiple of R
    *_styles(*[RopeCase(3, 61, 7, 92, dtype=dt, kv_heads=3, label="odd sizes")
               for dt in ("fp32", "fp16", "bf16")]),
    *_styles(*[RopeCase(2, 37, 5, 80, rotary_dim=48, layout=layout, dtype=dt, kv_heads=2,
                        label="d=80 R=48") for dt in ("fp32", "fp16", "bf16")
               for layout in ("bshd", "bhsd")]),
    # per-row random ids, per-sequence offsets, another base
    *_styles(*[RopeCase(3, 50, 4, 64, layout=layout, positions="ids", dtype="bf16", kv_heads=2,
                        label="per-row ids") for layout in ("bshd", "sbhd", "bhsd")],
             RopeCase(4, 64, 3, 32, positions="ids", kv_heads=1, label="thd ids", **THD),
             *[RopeCase(3, 50, 4, 64, layout=layout, positions="offset", dtype="fp16",
                        label="offsets") for layout in ("sbhd", "bhsd")],
             RopeCase(2, 40, 4, 64, base=500000.0, positions="ids", max_position=8192,
                      label="base 5e5")),
    # uneven thd (one sequence of length 1)
    *_styles(*[RopeCase(4, 64, 3, 32, dtype=dt, kv_heads=2, label="thd uneven", **THD)
               for dt in ("fp32", "fp16", "bf16")]),
    # tables in x's dtype
    *_styles(*[RopeCase(2, 40, 4, 64, dtype=dt, cos_sin_dtype="same", kv_heads=4,
                        label="tables in x's dtype") for dt in ("fp16", "bf16")]),
    # backward: asymmetric tables (random dy), broadcast (zero-stride) dy, random dy
    *_styles(*[RopeCase(2, 33, 4, 64, layout=layout, dtype=dt, direction="backward",
                        asymmetric=True, kv_heads=2, label="backward, asymmetric tables")
               for dt in ("fp32", "bf16") for layout in ("bshd", "sbhd")]),
    *_styles(*[RopeCase(2, 33, 4, 64, dtype=dt, direction="backward", grad=grad, kv_heads=2,
                        label=f"backward, {grad} dy")
               for dt in ("fp32", "fp16", "bf16") for grad in ("random", "broadcast")]),
    *_styles(RopeCase(2, 37, 5, 80, rotary_dim=48, dtype="bf16", direction="backward",
                      asymmetric=True, contiguous=False, kv_heads=1,
                      label="backward, partial, packed, MQA"),
             RopeCase(4, 64, 3, 32, direction="backward", grad="broadcast", positions="ids",
                      kv_heads=2, label="backward thd", **THD)),
]
CASES = [small(c) for name in CROSSVAL_SUITES for c in get_suite(name)] + EDGE_CASES


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.label}: {c.describe()}")
def test_fastrope_specs_cross_validate(case):
    """fastrope.rope, fastrope.rope_computed and fastrope.rope_inplace match the oracle (computed
    angles may decline asymmetric tables, with a reason)."""
    report = run_case(case, FASTROPE, seed=_seed(case), timing_on=False, targets=CUDA, device=DEV)
    assert {r.impl for r in report.results} == {s.name for s in FASTROPE}
    for r in report.results:
        if r.status == "unsupported" and r.impl == "fastrope.rope_computed":
            assert r.reason and case.asymmetric, (r.impl, r.reason)
            continue
        assert r.status == "ok", (f"{r.impl} on {case.describe()}: {r.status} {r.reason} "
                                  f"(err/tol {r.err_over_tol})")


@pytest.mark.slow
def test_more_than_2_31_elements():
    """1 x 16385 x 1024 x 128 bf16 (2^31 + 2^17 elements): 64-bit offsets, every element checked."""
    if torch.cuda.get_device_properties(0).total_memory < 40e9:
        pytest.skip("needs a GPU with 40 GB or more (about 17 GB peak for inputs, copy and output)")
    case = RopeCase(1, 16385, 1024, 128, dtype="bf16", cos_sin_dtype="same",
                    label="long: 2^31 + 2^17 elements")
    assert case.numel > 2**31
    report = run_case(case, [registry.get("fastrope.rope")], seed=0, timing_on=False,
                      targets=CUDA, device=DEV)
    (result,) = report.results
    assert result.status == "ok", f"{result.status}: {result.reason}"


# ---- in place ---------------------------------------------------------------------------------
INPLACE_CASES = [
    RopeCase(2, 48, 32, 128, dtype="bf16", kv_heads=8, label="gqa bf16"),
    RopeCase(3, 61, 7, 92, layout="sbhd", dtype="fp16", style="interleaved", rotary_dim=60,
             contiguous=False, kv_heads=3, label="packed, partial, interleaved"),
    RopeCase(4, 64, 3, 32, dtype="fp32", positions="ids", kv_heads=2, label="thd ids", **THD),
    RopeCase(2, 40, 4, 64, layout="bhsd", dtype="bf16", positions="offset", kv_heads=4,
             label="bhsd offsets"),
    RopeCase(2, 40, 4, 64, dtype="fp32", rotary_dim=32, label="q only, partial"),
]


@pytest.mark.parametrize("computed", [False, True], ids=["tables", "computed"])
@pytest.mark.parametrize("case", INPLACE_CASES, ids=lambda c: c.label)
def test_inplace_is_deterministic_and_matches_out_of_place(case, computed):
    """apply_rope_inplace on two copies of the same input gives bit-identical results, three
    times over (each call rotating the previous result again), each equal bit for bit to
    apply_rope on the same values; it returns the tensors it was given, and for q/k cut from a
    packed qkv the rest of the packed buffer is untouched."""
    inputs = make_inputs(case, _seed(case), DEV)
    kw = _kwargs(case, inputs, computed)
    a = [_copy_like(x) for x in inputs.xs]
    b = [_copy_like(x) for x in inputs.xs]
    assert all(x.stride() == y.stride() for x, y in zip(a, inputs.xs))
    rests = []
    if not case.contiguous:
        for x in a:
            axis, heads = _HEAD_AXIS[case.layout], x.shape[_HEAD_AXIS[case.layout]]
            rest = x._base.narrow(axis, heads, x._base.shape[axis] - heads)
            rests.append((rest, rest.clone()))
    for step in range(3):
        before = [x.clone() for x in a]
        want = _tuple(apply_rope(*before, **kw))
        got_a = _tuple(apply_rope_inplace(*a, **kw))
        got_b = _tuple(apply_rope_inplace(*b, **kw))
        assert all(g is x for g, x in zip(got_a, a)) and all(g is x for g, x in zip(got_b, b))
        for i, (x, y, w, prev) in enumerate(zip(a, b, want, before)):
            assert _same_bits(x, y), f"step {step}, tensor {i}: two in-place runs differ"
            assert _same_bits(x.contiguous(), w), f"step {step}, tensor {i}: != apply_rope"
            assert not torch.equal(x.contiguous(), prev), f"step {step}: nothing rotated"
    for rest, saved in rests:
        assert _same_bits(rest, saved), "in-place call wrote outside q/k in the packed buffer"


# ---- out of place: inputs unchanged, every output written ----------------------------------------
API_CASES = [
    RopeCase(2, 33, 6, 64, layout="sbhd", dtype="bf16", contiguous=False, kv_heads=2,
             label="packed sbhd"),
    RopeCase(3, 61, 7, 92, dtype="fp32", style="interleaved", kv_heads=3, positions="ids",
             label="odd sizes, ids"),
    RopeCase(2, 37, 5, 80, rotary_dim=48, layout="bhsd", dtype="fp16", kv_heads=1,
             positions="offset", label="partial, MQA, offsets"),
    RopeCase(4, 64, 3, 32, dtype="bf16", kv_heads=2, contiguous=False, label="thd packed", **THD),
    RopeCase(2, 48, 32, 128, dtype="bf16", kv_heads=8, label="gqa"),
    RopeCase(64, 1, 32, 128, dtype="bf16", positions="offset", max_position=4096, kv_heads=8,
             label="decode step"),
]


def _snapshot(*tensors):
    return [(t, t.clone()) for t in tensors if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("computed", [False, True], ids=["tables", "computed"])
@pytest.mark.parametrize("case", API_CASES, ids=lambda c: c.label)
def test_out_of_place_leaves_inputs_unchanged(case, computed):
    """q, k (and their packed buffers), cos, sin, positions, offsets and cu_seqlens are bitwise
    unchanged by apply_rope, forward and backward (dy unchanged too)."""
    inputs = make_inputs(case, _seed(case), DEV)
    kw = _kwargs(case, inputs, computed)
    watched = [x._base if x._base is not None else x for x in inputs.xs]
    saved = _snapshot(*watched, *inputs.xs, *kw.values())
    outs = _tuple(apply_rope(*inputs.xs, **kw))
    leaves = [x.detach().requires_grad_(True) for x in inputs.xs]
    grads = [torch.randn_like(o) for o in outs]
    saved += _snapshot(*grads)
    torch.autograd.backward(_tuple(apply_rope(*leaves, **kw)), grads)
    torch.cuda.synchronize()
    for t, before in saved:
        assert _same_bits(t, before), f"an input of shape {tuple(t.shape)} was modified"
    for out, x in zip(outs, inputs.xs):
        assert out.data_ptr() != x.data_ptr() and out.is_contiguous()
        assert not torch.equal(out, x.contiguous())


def test_poisoning_is_active():
    """Guard for the next test: under poisoned(), fresh outputs start as NaN."""
    with _alloc.poisoned():
        t = _alloc.empty((64,), dtype=torch.bfloat16, device=DEV)
    assert torch.isnan(t).all()


@pytest.mark.parametrize("computed", [False, True], ids=["tables", "computed"])
@pytest.mark.parametrize("case", API_CASES, ids=lambda c: c.label)
def test_every_output_element_is_written(case, computed):
    """With outputs NaN-poisoned, no NaN survives in the forward outputs or in the gradients."""
    inputs = make_inputs(case, _seed(case), DEV)
    kw = _kwargs(case, inputs, computed)
    leaves = [x.detach().requires_grad_(True) for x in inputs.xs]
    with _alloc.poisoned():
        outs = _tuple(apply_rope(*inputs.xs, **kw))
        outs_g = _tuple(apply_rope(*leaves, **kw))
        grads = torch.autograd.grad(outs_g, leaves, [torch.randn_like(o) for o in outs_g])
    for i, t in enumerate([*outs, *outs_g, *grads]):
        assert not torch.isnan(t).any(), f"tensor {i}: {int(torch.isnan(t).sum())} NaN elements"


# ---- the pass-through tail -----------------------------------------------------------------------
_NAN_PAYLOAD = {torch.float32: 0x7FC00123, torch.float16: 0x7E03, torch.bfloat16: 0x7FC3}


def _plant_specials(x: torch.Tensor, rot: int) -> None:
    """Write -0.0, +-inf, a subnormal and a NaN with a payload into x's tail (in place): a tail
    that goes through float arithmetic or conversion would change some of their bits."""
    tail = x[..., rot:]
    flat_first = tail.select(-2, 0)  # the first head of every token
    specials = torch.tensor([-0.0, float("inf"), -float("inf"), torch.finfo(x.dtype).tiny / 4],
                            dtype=x.dtype, device=x.device)
    n = min(4, tail.shape[-1])
    flat_first[..., :n] = specials[:n]
    if tail.shape[-1] > 4:
        int_dtype = {4: torch.int32, 2: torch.int16}[x.element_size()]
        payload = _NAN_PAYLOAD[x.dtype]
        if int_dtype == torch.int16 and payload >= 2**15:
            payload -= 2**16
        flat_first[..., 4:5].view(int_dtype).fill_(payload)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("head_dim,rot,contiguous", [(80, 48, True), (128, 32, False),
                                                     (92, 60, True)])
def test_partial_rotary_tail_is_bit_exact(dtype, style, head_dim, rot, contiguous):
    """out[..., R:] == x[..., R:] bit for bit (out of place, in place and dx = dy in backward),
    with special values planted in the tail; they never leak into the rotated channels."""
    case = RopeCase(2, 37, 5, head_dim, rotary_dim=rot, dtype=dtype, style=style,
                    contiguous=contiguous, kv_heads=2, label="tail")
    inputs = make_inputs(case, _seed(case), DEV)
    for x in inputs.xs:
        _plant_specials(x, rot)
    kw = _kwargs(case, inputs)
    outs = _tuple(apply_rope(*inputs.xs, **kw))
    for out, x in zip(outs, inputs.xs):
        assert _same_bits(out[..., rot:], x[..., rot:].contiguous())
        assert torch.isfinite(out[..., :rot]).all()
    copies = [_copy_like(x) for x in inputs.xs]
    apply_rope_inplace(*copies, **kw)
    for c, x, out in zip(copies, inputs.xs, outs):
        assert _same_bits(c[..., rot:].contiguous(), x[..., rot:].contiguous())
        assert _same_bits(c.contiguous(), out)
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs.xs]
    grads = [torch.randn(x.shape, device=DEV).to(x.dtype) for x in inputs.xs]
    for g in grads:
        _plant_specials(g, rot)
    dxs = torch.autograd.grad(_tuple(apply_rope(*leaves, **kw)), leaves, grads)
    for dx, g in zip(dxs, grads):
        assert _same_bits(dx[..., rot:].contiguous(), g[..., rot:].contiguous())
        assert torch.isfinite(dx[..., :rot]).all()


# ---- accuracy at long positions ------------------------------------------------------------------
LONG = 131072
# The inputs are drawn on the CPU, so they are the same on every machine. With fp32 outputs one
# ulp is tight: x*c - y*s in fp32 rounds a product and the sum (each <= 0.5 ulp), and computed
# cos/sin carry their own fp32 rounding, so a correct kernel lands anywhere up to ~1.3 ulp
# depending on the draw. This seed was checked on the CPU by emulating the kernel's fp32
# arithmetic (with and without fused multiply-adds): <= 0.69 ulp for fp32, <= 0.5 for fp16/bf16.
LONG_SEED = 8


def long_case(dtype: str, style: str) -> RopeCase:
    return RopeCase(2, 64, 4, 128, dtype=dtype, style=style, positions="ids", max_position=LONG,
                    kv_heads=2, label="128k positions")


def long_inputs(case: RopeCase, source: str, device) -> tuple[RopeInputs, dict]:
    """Inputs drawn on the CPU (so the values are the same on every machine), with the last
    positions (LONG - 1, LONG - 2) and 0 planted, moved to ``device``; and the call's kwargs."""
    inputs = make_inputs(case, LONG_SEED, "cpu")
    pos = inputs.positions.clone()
    pos[0, :3] = torch.tensor([LONG - 1, LONG - 2, 0])
    pos[-1, -1] = LONG - 1
    inputs = dataclasses.replace(inputs, positions=pos)
    kw = dict(style=case.style, positions=pos)
    if source == "tables":
        kw.update(cos=inputs.cos, sin=inputs.sin)
    elif source == "inv_freq":  # a scaled frequency set (linear scaling by 8: exact in fp64)
        inv = inputs.inv_freq / 8
        angles = torch.arange(LONG, dtype=torch.float64)[:, None] * inv
        inputs = dataclasses.replace(inputs, inv_freq=inv, angles=angles)
        kw.update(inv_freq=inv)
    inputs = _to(inputs, device)
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return inputs, kw


@pytest.mark.parametrize("source", ["tables", "computed", "inv_freq"])
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_accuracy_at_long_positions(dtype, style, source):
    """Positions up to 128k: max |out - ref| <= 1 ulp of max |ref| in the output dtype, for
    given fp32 tables (against those tables) and for angles computed in the kernel from base or
    from a given inv_freq (against the exact float64 angles)."""
    case = long_case(dtype, style)
    inputs, kw = long_inputs(case, source, DEV)
    outs = _tuple(apply_rope(*inputs.xs, **kw))
    refs = expected(case, inputs, "tables" if source == "tables" else "computed")
    for i, (out, ref) in enumerate(zip(outs, refs)):
        bound = ulp(float(ref.abs().max()), case.torch_dtype)
        err = float((out.double() - ref).abs().max())
        assert err <= bound, f"tensor {i}: max err {err:.3g} = {err / bound:.3f} ulp"


# ---- autograd ---------------------------------------------------------------------------------
GRAD_CASES = [
    *_styles(*[RopeCase(2, 33, 4, 64, layout=layout, dtype=dt, direction="backward",
                        asymmetric=True, kv_heads=2, label=f"asymmetric {layout} {dt}")
               for layout in ("bshd", "bhsd") for dt in ("fp32", "bf16")]),
    *_styles(RopeCase(4, 64, 3, 32, direction="backward", asymmetric=True, positions="ids",
                      kv_heads=1, label="asymmetric thd", **THD),
             RopeCase(2, 37, 5, 80, rotary_dim=48, dtype="fp16", direction="backward",
                       asymmetric=True, contiguous=False, kv_heads=2, label="asymmetric partial"),
             *[RopeCase(2, 33, 4, 64, layout="sbhd", dtype=dt, direction="backward",
                        grad="broadcast", kv_heads=2, positions="offset",
                        label=f"broadcast dy {dt}") for dt in ("fp32", "bf16")]),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.label + " " + c.style)
def test_backward_matches_the_oracle(case):
    """out.backward(dy) gives the exact transpose (asymmetric tables expose a backward that uses
    a member's own sine); broadcast dy is the zero-stride tensor autograd hands back."""
    inputs = make_inputs(case, _seed(case), DEV)
    if case.grad == "broadcast":
        assert all(0 in g.stride() for g in inputs.grads)
    leaves = [x.detach().requires_grad_(True) for x in inputs.xs]
    torch.autograd.backward(_tuple(apply_rope(*leaves, **_kwargs(case, inputs))), inputs.grads)
    _assert_matches_oracle(case, inputs, [x.grad for x in leaves], what="grad")


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sum_backward_and_computed_angles(style, dtype):
    """(sum(out) * 2).backward() (autograd's own broadcast dy), with tables and with computed
    angles, matches the oracle."""
    case = RopeCase(2, 33, 4, 64, dtype=dtype, style=style, direction="backward",
                    grad="broadcast", kv_heads=2, positions="ids", label="sum backward")
    inputs = make_inputs(case, _seed(case), DEV)
    for computed in (False, True):
        leaves = [x.detach().requires_grad_(True) for x in inputs.xs]
        q, k = apply_rope(*leaves, **_kwargs(case, inputs, computed))
        (q.sum() * 2 + k.sum() * 2).backward()
        _assert_matches_oracle(case, inputs, [x.grad for x in leaves],
                               "computed" if computed else "tables", what="grad")


@pytest.mark.parametrize("case", [GRAD_CASES[0], GRAD_CASES[3], GRAD_CASES[8], GRAD_CASES[-1]],
                         ids=lambda c: c.label + " " + c.style)
def test_inplace_autograd_matches_out_of_place(case):
    """x.clone() rotated by apply_rope_inplace inside autograd: the same outputs and the same
    gradients, bit for bit, as apply_rope on the leaves."""
    inputs = make_inputs(case, _seed(case), DEV)
    kw = _kwargs(case, inputs)
    leaves_a = [x.detach().requires_grad_(True) for x in inputs.xs]
    outs_a = _tuple(apply_rope(*leaves_a, **kw))
    torch.autograd.backward(outs_a, inputs.grads)
    leaves_b = [x.detach().requires_grad_(True) for x in inputs.xs]
    clones = [x.clone() for x in leaves_b]
    outs_b = _tuple(apply_rope_inplace(*clones, **kw))
    assert all(o is c for o, c in zip(outs_b, clones))
    assert all(o.requires_grad for o in outs_b)
    torch.autograd.backward(outs_b, inputs.grads)
    for a, b, la, lb in zip(outs_a, outs_b, leaves_a, leaves_b):
        assert _same_bits(a.detach(), b.detach().contiguous())
        assert lb.grad is not None and _same_bits(la.grad, lb.grad)
    _assert_matches_oracle(case, inputs, [x.grad for x in leaves_b], what="grad")


# ---- position forms and table forms --------------------------------------------------------------
@pytest.mark.parametrize("style", STYLES)
def test_equivalent_position_and_table_forms_agree_bitwise(style):
    """int32 and int64 ids, [s] and [b, s] (also zero-stride) ids, an int offset, an offset tensor
    and the equivalent ids, half-width [L, R/2] and full tables, and a strided table view: all
    give the same bits."""
    case = RopeCase(3, 20, 4, 64, dtype="bf16", style=style, kv_heads=2, positions="ids",
                    max_position=256, label="forms")
    inputs = make_inputs(case, _seed(case), DEV)
    q, k = inputs.xs
    tab = dict(cos=inputs.cos, sin=inputs.sin, style=style)
    ids = inputs.positions
    base = apply_rope(q, k, positions=ids, **tab)
    same = lambda out: all(_same_bits(a, b) for a, b in zip(out, base))
    assert same(apply_rope(q, k, positions=ids.to(torch.int32), **tab))
    assert same(apply_rope(q, k, positions=ids.t().contiguous().t(), **tab))  # strided ids

    shared = ids[1]
    ref = apply_rope(q, k, positions=shared.expand(3, 20).contiguous(), **tab)
    for form in (shared, shared.expand(3, 20), shared.to(torch.int32)):
        out = apply_rope(q, k, positions=form, **tab)
        assert all(_same_bits(a, b) for a, b in zip(out, ref))

    arange = torch.arange(20, device=DEV)
    by_int = apply_rope(q, k, offsets=7, **tab)
    by_tensor = apply_rope(q, k, offsets=torch.full((3,), 7, device=DEV), **tab)
    by_ids = apply_rope(q, k, positions=arange + 7, **tab)
    assert all(_same_bits(a, b) and _same_bits(a, c) for a, b, c in zip(by_int, by_tensor, by_ids))
    offs = torch.tensor([0, 100, 31], device=DEV, dtype=torch.int32)
    by_offs = apply_rope(q, k, offsets=offs, **tab)
    by_ids = apply_rope(q, k, positions=offs[:, None].long() + arange, **tab)
    assert all(_same_bits(a, b) for a, b in zip(by_offs, by_ids))

    half = dict(cos=first_members(inputs.cos, style).contiguous(),
                sin=first_members(inputs.sin, style).contiguous(), style=style)
    assert same(apply_rope(q, k, positions=ids, **half))
    wide_c = torch.randn(256, 96, device=DEV)
    wide_s = torch.randn(256, 96, device=DEV)
    wide_c[:, 16:80], wide_s[:, 16:80] = inputs.cos, inputs.sin
    strided = dict(cos=wide_c[:, 16:80], sin=wide_s[:, 16:80], style=style)
    assert same(apply_rope(q, k, positions=ids, **strided))


def test_ids_and_an_offsets_tensor_of_one_shape_are_different_calls():
    """Ids [s] and an offsets tensor [b] of the same dtype and shape (b == s) are different
    problems: the second call must not reuse the first one's cached plan."""
    case = RopeCase(4, 4, 2, 64, dtype="fp32", positions="ids", max_position=64, label="b == s")
    inputs = make_inputs(case, _seed(case), DEV)
    q = inputs.xs[0]
    tab = dict(cos=inputs.cos, sin=inputs.sin)
    v = torch.tensor([3, 9, 1, 20], device=DEV)
    by_ids = apply_rope(q, positions=v, **tab)
    by_offsets = apply_rope(q, offsets=v, **tab)
    assert _same_bits(by_ids, apply_rope(q, positions=v.expand(4, 4).contiguous(), **tab))
    assert _same_bits(by_offsets,
                      apply_rope(q, positions=v[:, None] + torch.arange(4, device=DEV), **tab))



@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("positions", ["arange", "int offset", "offsets", "ids", "thd"])
def test_heads_per_step_do_not_change_the_bits(style, positions):
    """Small shapes take the step kernel (thd: the main kernel, one head per step); the main
    kernel with one head per step and with 2 and 4 (the prefill plans, where given tables load
    before the first rows unless the position is read from memory) gives the same bits, forward
    and backward, with full and half-width tables, out of place and in place."""
    thd = positions == "thd"
    case = RopeCase(4, 64, 3, 32, kv_heads=2, style=style, dtype="bf16",
                    positions="ids" if positions == "ids" else "arange", max_position=256,
                    label="heads per step", **(THD if thd else {}))
    inputs = make_inputs(case, _seed(case), DEV)
    kw = dict(style=style, layout=case.layout)
    if thd:
        kw.update(cu_seqlens=inputs.cu_seqlens, max_seqlen=max(case.seqlens))
    kw.update({"int offset": dict(offsets=5), "ids": dict(positions=inputs.positions),
               "offsets": dict(offsets=torch.tensor([3, 0, 9, 1], device=DEV))}.get(positions, {}))
    half = dict(cos=first_members(inputs.cos, style).contiguous(),
                sin=first_members(inputs.sin, style).contiguous())
    grads = [torch.randn_like(x) for x in inputs.xs]

    def run(tables, variant=None, in_place=False):
        """Outputs and gradients; the public functions (the design) when ``variant`` (an
        ablation) is None."""
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs.xs]
        if variant is None:
            fn = apply_rope_inplace if in_place else apply_rope
        else:
            fn = functools.partial(
                ablation.apply_rope_inplace if in_place else ablation.apply_rope,
                ablation=variant)
        outs = _tuple(fn(*([x.clone() for x in leaves] if in_place else leaves), **kw, **tables))
        torch.autograd.backward(outs, grads)
        return [o.detach() for o in outs] + [x.grad for x in leaves]

    for tables in (dict(cos=inputs.cos, sin=inputs.sin), half):
        base = run(tables)
        variants = ("no_step_kernel", ablation.heads_per_step(2), ablation.heads_per_step(4))
        for variant, in_place in itertools.product(variants, (False, True)):
            got = run(tables, variant, in_place)
            assert all(_same_bits(a, b) for a, b in zip(got, base)), (variant, in_place)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_computed_angle_steps_fit_three_blocks_with_the_same_bits(dtype):
    """Computed angles with 4 heads per step (the prefill plan from 8x the resident threads):
    rope.cu caps that kernel to 3 resident blocks of 256 threads per SM (<= 80 registers), and
    it gives the bits of 1 and 2 heads per step, forward and backward, out of place and in
    place."""
    from cupy_backends.cuda.api import driver

    vector = kernel._full_width(DTYPES[dtype])
    name = kernel.kernel_name(DTYPES[dtype], torch.float32, vector, False, True, 32, 4)
    regs = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS,
                                   kernel.function_ptr(DEV.index or 0, name))
    assert 3 * 256 * regs <= 65536, f"{name}: {regs} registers"
    case = RopeCase(2, 64, 5, 64, kv_heads=3, dtype=dtype, label="computed heads per step")
    inputs = make_inputs(case, _seed(case), DEV)
    grads = [torch.randn_like(x) for x in inputs.xs]

    def run(unroll, in_place):
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs.xs]
        fn = ablation.apply_rope_inplace if in_place else ablation.apply_rope
        xs = [x.clone() for x in leaves] if in_place else leaves
        outs = _tuple(fn(*xs, inv_freq=inputs.inv_freq,
                         ablation=ablation.heads_per_step(unroll)))
        torch.autograd.backward(outs, grads)
        return [o.detach() for o in outs] + [x.grad for x in leaves]

    base = run(1, False)
    for unroll, in_place in itertools.product((2, 4), (False, True)):
        got = run(unroll, in_place)
        assert all(_same_bits(a, b) for a, b in zip(got, base)), (unroll, in_place)


@pytest.mark.parametrize("dtype,kv_heads,out_of_place,in_place", [
    ("fp16", None, (4, 2), (4, 2)), ("bf16", 8, (4, 4), (4, 4)), ("fp32", None, (4, 4), (4, 2)),
    ("fp32", 8, (4, 4), (4, 4))])
def test_past_the_l2_plans_keep_the_bits(monkeypatch, dtype, kv_heads, out_of_place, in_place):
    """Rotate-half from tables whose data outlives the L2 (in place too; sized from this GPU's L2
    and SMs, past the step kernel's bound) takes plan.py's rules, (V, heads per step) per mode:
    16-bit 8-byte accesses and 2 heads (32 heads; its kernel fits 4 resident blocks of 256
    threads per SM, <= 64 registers) or 4 (40 heads, where 2 leaves head slots idle); fp32 16
    bytes and 4 heads out of place, and in place 2 (32 heads: one step per thread; 3 blocks,
    <= 85 registers) or 4 (40 heads); the backward runs out of place. The outputs and gradients
    (asymmetric tables) are the bits of the wide_steps_past_l2 ablation (16 bytes, 4 heads per
    step). plan.RULES themselves, not this GPU's tuning table (the H200's takes 4 heads for 16-bit
    data here; the alternatives' tests cover the tables)."""
    from cupy_backends.cuda.api import driver

    monkeypatch.setattr(plan, "device_rules", lambda index: plan.RULES)
    chosen = []
    real = plan.choose_from
    monkeypatch.setattr(plan, "choose_from",
                        lambda *a, **kw: chosen.append(real(*a, **kw)) or chosen[-1])
    htot, token_bytes = 32 + (kv_heads or 0), 32 * 128 * 2
    seqlen = 256 + max(plan.l2_bytes(0) // token_bytes,
                       8 * plan.sm_count(0) * 2048 // (htot * 8))
    case = RopeCase(1, seqlen, 32, 128, kv_heads=kv_heads, dtype=dtype, asymmetric=True,
                    label="past the L2")
    inputs = make_inputs(case, _seed(case), DEV)
    grads = [torch.randn_like(x) for x in inputs.xs]

    def run(variant, in_place):
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs.xs]
        fn = _design(in_place) if variant is None else functools.partial(
            ablation.apply_rope_inplace if in_place else ablation.apply_rope, ablation=variant)
        outs = _tuple(fn(*([x.clone() for x in leaves] if in_place else leaves),
                         cos=inputs.cos, sin=inputs.sin))
        torch.autograd.backward(outs, grads)
        return [o.detach() for o in outs] + [x.grad for x in leaves]

    for mode, forward in ((False, out_of_place), (True, in_place)):
        chosen.clear()
        got = run(None, mode)
        # the forward, then the backward (out of place on dy) where not cached
        plans = [(p.vector, p.unroll) for p in chosen]
        assert plans and plans[0] == forward and set(plans) <= {forward, out_of_place}, plans
        blocks = {(2, 2): 4, (4, 2): 3}.get((inputs.xs[0].element_size(), forward[1]))
        if blocks:
            regs = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS,
                                           kernel.function_ptr(DEV.index or 0, chosen[0].kernel))
            assert blocks * 256 * regs <= 65536, f"{chosen[0].kernel}: {regs} registers"
        chosen.clear()
        wide = run("wide_steps_past_l2", mode)
        sixteen_bytes = 16 // inputs.xs[0].element_size()
        assert chosen and all((p.vector, p.unroll) == (sixteen_bytes, 4) for p in chosen), chosen
        assert all(_same_bits(a, b) for a, b in zip(got, wide)), mode
        assert not torch.equal(got[0], inputs.xs[0])  # rotated


@pytest.mark.parametrize("layout,dtype,positions", [("bshd", "bf16", "offset"),
                                                     ("sbhd", "fp32", "ids"),
                                                     ("bhsd", "fp16", "arange")])
def test_mid_sized_problems_take_the_step_kernel_with_the_main_kernels_bits(
        monkeypatch, layout, dtype, positions):
    """A prefill of about 3x the resident threads' chunk-rows (sized from this GPU's SMs; under
    plan.step_work_bound) takes the step kernel; its outputs and gradients (asymmetric tables)
    are the main kernel's bits (the no_step_kernel ablation), out of place and in place."""
    chosen = []
    real = plan.choose_from
    monkeypatch.setattr(plan, "choose_from",
                        lambda *a, **kw: chosen.append(real(*a, **kw)) or chosen[-1])
    chunks = 8 if dtype != "fp32" else 16  # 16-byte chunk threads per row of 128
    batch, kv = (1, 8) if layout != "bhsd" else (2, None)
    htot = 32 + (kv or 0)
    seqlen = 3 * plan.sm_count(0) * 2048 // (htot * chunks * batch)
    case = RopeCase(batch, seqlen, 32, 128, kv_heads=kv, layout=layout, dtype=dtype,
                    positions=positions, max_position=2 * seqlen + 64, asymmetric=True,
                    label="step kernel band")
    inputs = make_inputs(case, _seed(case), DEV)
    kw = dict(layout=layout, cos=inputs.cos, sin=inputs.sin)
    kw.update({"offset": dict(offsets=inputs.offsets),
               "ids": dict(positions=inputs.positions)}.get(positions, {}))
    grads = [torch.randn_like(x) for x in inputs.xs]

    def run(variant, in_place):
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs.xs]
        fn = _design(in_place) if variant is None else functools.partial(
            ablation.apply_rope_inplace if in_place else ablation.apply_rope, ablation=variant)
        outs = _tuple(fn(*([x.clone() for x in leaves] if in_place else leaves),
                         **kw))
        torch.autograd.backward(outs, grads)
        return [o.detach() for o in outs] + [x.grad for x in leaves]

    for in_place in (False, True):
        chosen.clear()
        got = run(None, in_place)
        assert chosen and all(p.step for p in chosen), [p.kernel for p in chosen]
        # in place on 16-bit data past 2x the resident threads: 2 or 4 heads per thread, or
        # what this GPU's tuning table chose for the row
        row = "several heads per step thread in place"
        choice = tuning.choices(DEV.index or 0).get(row)
        several = (plan.ALTERNATIVES[row][choice]["step_heads"] if choice
                   else 4 if kv is None else 2)
        assert chosen[0].unroll == (1 if not in_place or dtype == "fp32" else several)
        chosen.clear()
        main = run("no_step_kernel", in_place)
        assert chosen and not any(p.step for p in chosen), [p.kernel for p in chosen]
        assert all(_same_bits(a, b) for a, b in zip(got, main)), in_place
        assert not torch.equal(got[0], inputs.xs[0])  # rotated


def _first_trial_of_each_mode(row):
    from ports.harness import tune

    return [next(t for t in tune.TRIALS[row] if t.in_place == m)
            for m in (False, True) if any(t.in_place == m for t in tune.TRIALS[row])]


@pytest.mark.parametrize("row, trial", [(row, trial) for row in sorted(plan.ALTERNATIVES)
                                        for trial in _first_trial_of_each_mode(row)],
                         ids=lambda x: getattr(x, "label", x))
def test_every_tuning_alternative_gives_the_rows_own_bits(row, trial):
    """Each alternative a tuning table may choose (plan.ALTERNATIVES) rotates the first case of
    each mode the tuning command times its row on (ports.harness.tune) to the bits of the row's
    own settings, with a plan of its own where it changes one."""
    from ports.fastrope import experiment
    from ports.harness import tune

    xs, kw = tune.trial_inputs(trial)
    own_plans = experiment.plans(*[x.clone() for x in xs], choices={}, in_place=trial.in_place,
                                 **kw)
    own = _tuple(experiment.apply_rope(*[x.clone() for x in xs], choices={},
                                       in_place=trial.in_place, **kw))
    changed = 0
    for alternative in plan.ALTERNATIVES[row]:
        choice = {row: alternative}
        changed += experiment.plans(*[x.clone() for x in xs], choices=choice,
                                    in_place=trial.in_place, **kw) != own_plans
        got = _tuple(experiment.apply_rope(*[x.clone() for x in xs], choices=choice,
                                           in_place=trial.in_place, **kw))
        assert all(_same_bits(a, b) for a, b in zip(got, own)), alternative
    assert changed, f"no alternative of {row!r} changes the plan of {trial.label}"
    assert not torch.equal(own[0], xs[0])  # rotated


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("batch", [2, 6, 8])
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_token_tiles_across_the_batch(monkeypatch, dtype, batch, in_place):
    """sbhd with B > 1 in token tiles (the tiles run across the batch, kernel.BATCH_TILES), with
    each sequence at its own offset: within the oracle's tolerance, every element written, and
    the design's bits. The L2 is taken as 64 KiB so the tiles' rows hold on a small input."""
    from ports.fastrope import experiment

    case = RopeCase(batch, 48, 6, 128, layout="sbhd", dtype=dtype, kv_heads=2,
                    positions="offset", max_position=4096, label="tiles across the batch")
    inputs = make_inputs(case, _seed(case), DEV)
    kw = _kwargs(case, inputs)
    monkeypatch.setattr(plan, "l2_bytes", lambda index: 64 * 1024)
    row = f"{'in' if in_place else 'out of'} place from twice the L2: token tiles"
    choice = {row: "the step kernel in tiles of 8 tokens"}
    tiles = experiment.plans(*inputs.xs, choices=choice, in_place=in_place, **kw)
    assert all(p.step and _flag_bits(p) & kernel.BATCH_TILES for p in tiles), tiles

    def rotate(choices):  # fresh outputs NaN-poisoned
        xs = [x.clone() for x in inputs.xs]
        with _alloc.poisoned():
            got = experiment.apply_rope(*xs, choices=choices, in_place=in_place, **kw)
        return xs if in_place else list(_tuple(got))

    got = rotate(choice)
    _assert_matches_oracle(case, inputs, got)
    assert all(_same_bits(a, b) for a, b in zip(got, rotate({})))


def _flag_bits(p) -> int:
    """The FLAGS template argument of a plan's kernel."""
    args = p.kernel[p.kernel.index("<") + 1:-1].split(", ")
    return int(args[4] if p.step else args[7])


def _design(in_place):
    return apply_rope_inplace if in_place else apply_rope


def test_empty_inputs_and_zero_head_k():
    """No tokens: empty outputs, no launch error; k with zero heads: q still rotated."""
    q = torch.randn(0, 5, 4, 32, device=DEV)
    assert apply_rope(q).shape == q.shape
    case = RopeCase(2, 5, 4, 32, kv_heads=1, label="zero-head k")
    inputs = make_inputs(case, 1, DEV)
    k0 = torch.randn(2, 5, 0, 32, device=DEV)
    out_q, out_k = apply_rope(inputs.xs[0], k0, cos=inputs.cos, sin=inputs.sin)
    assert out_k.shape == k0.shape
    _assert_matches_oracle(case, dataclasses.replace(inputs, xs=inputs.xs[:1]), [out_q])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_misaligned_views(dtype):
    """A q that starts one element into its buffer (not 4/8/16-byte aligned): rotate-half narrows
    its accesses and matches the oracle; interleaved either matches too or refuses on the host."""
    for style in STYLES:
        case = RopeCase(2, 16, 4, 64, dtype={torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype],
                        style=style, label="misaligned")
        inputs = make_inputs(case, 3, DEV)
        flat = torch.randn(1 + inputs.x.numel(), device=DEV).to(dtype)
        q = flat[1:].view(inputs.x.shape)
        q.copy_(inputs.x)
        assert q.data_ptr() % 16
        try:
            out = apply_rope(q, cos=inputs.cos, sin=inputs.sin, style=style)
        except ValueError as exc:
            assert style == "interleaved" and "aligned" in str(exc), exc
            continue
        _assert_matches_oracle(case, inputs, [out])
    _valid_call_still_works()


# ---- errors on the GPU ---------------------------------------------------------------------------
def _valid_call_still_works():
    """A fresh valid call runs and matches the oracle: the context is not poisoned."""
    case = RopeCase(2, 12, 3, 32, kv_heads=1, positions="ids", label="after an error")
    inputs = make_inputs(case, 5, DEV)
    outs = apply_rope(*inputs.xs, **_kwargs(case, inputs))
    torch.cuda.synchronize()
    _assert_matches_oracle(case, inputs, outs)


ROWS = 32


def _error_setup():
    case = RopeCase(2, 16, 4, 32, kv_heads=2, positions="ids", max_position=ROWS, label="errors")
    inputs = make_inputs(case, 7, DEV)
    q, k = inputs.xs
    t = torch.randn(20, 4, 32, device=DEV)
    return q, k, t, inputs.cos, inputs.sin, inputs.positions


def _past_ids(pos):
    pos = pos.clone()
    pos[1, 3] = ROWS
    return pos


def _negative_ids(pos):
    pos = pos.clone()
    pos[0, 0] = -1
    return pos


def _cu(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


ERRORS = {
    "ids past the table": (IndexError, (rf"positions reach \[\d+, {ROWS}\] but cos/sin have "
                                        rf"{ROWS} rows"),
                           lambda q, k, t, c, s, p: dict(q=q, k=k, cos=c, sin=s,
                                                         positions=_past_ids(p))),
    "negative ids": (IndexError, "positions reach \\[-1, ",
                     lambda q, k, t, c, s, p: dict(q=q, k=k, cos=c, sin=s,
                                                   positions=_negative_ids(p))),
    "int32 ids past": (IndexError, "positions reach",
                       lambda q, k, t, c, s, p: dict(q=q, k=k, cos=c, sin=s,
                                                     positions=_past_ids(p).int())),
    "offset tensor past": (IndexError, rf"positions reach \[0, {ROWS}\]",
                           lambda q, k, t, c, s, p: dict(q=q, k=k, cos=c, sin=s,
                                                         offsets=torch.tensor([0, 17],
                                                                              device=DEV))),
    "int offset past": (IndexError, rf"positions reach \[17, {ROWS}\]",
                        lambda q, k, t, c, s, p: dict(q=q, k=k, cos=c, sin=s, offsets=17)),
    "arange, seqlen > rows": (IndexError, r"positions reach \[0, 15\] but cos/sin have 8 rows",
                              lambda q, k, t, c, s, p: dict(q=q, k=k, cos=c[:8], sin=s[:8])),
    "thd longest sequence > rows": (IndexError, r"positions reach \[0, 11\] but cos/sin have 8",
                                    lambda q, k, t, c, s, p: dict(
                                        q=t, cos=c[:8], sin=s[:8], layout="thd",
                                        cu_seqlens=_cu(0, 12, 20))),
    "cu_seqlens short of t": (ValueError, "cu_seqlens must rise from 0 to t = 20",
                              lambda q, k, t, c, s, p: dict(q=t, cos=c, sin=s, layout="thd",
                                                            cu_seqlens=_cu(0, 5, 19))),
    "cu_seqlens past t": (ValueError, "cu_seqlens must rise from 0 to t = 20",
                          lambda q, k, t, c, s, p: dict(q=t, layout="thd",
                                                        cu_seqlens=_cu(0, 5, 21))),
    "cu_seqlens falling": (ValueError, "cu_seqlens must rise",
                           lambda q, k, t, c, s, p: dict(q=t, cos=c, sin=s, layout="thd",
                                                         cu_seqlens=_cu(0, 15, 10, 20))),
    "max_seqlen too small": (ValueError, "max_seqlen 4 is below the longest sequence",
                             lambda q, k, t, c, s, p: dict(q=t, cos=c, sin=s, layout="thd",
                                                           cu_seqlens=_cu(0, 5, 20),
                                                           max_seqlen=4)),
    "k of another dtype": (TypeError, "k has dtype",
                           lambda q, k, t, c, s, p: dict(q=q, k=k.half(), cos=c, sin=s)),
    "k on the CPU": (ValueError, "k must be a CUDA tensor",
                     lambda q, k, t, c, s, p: dict(q=q, k=k.cpu(), cos=c, sin=s)),
    "positions on the CPU": (ValueError, "positions is on cpu",
                             lambda q, k, t, c, s, p: dict(q=q, k=k, cos=c, sin=s,
                                                           positions=p.cpu())),
    "cos on the CPU": (ValueError, "cos is on cpu",
                       lambda q, k, t, c, s, p: dict(q=q, cos=c.cpu(), sin=s.cpu())),
    "q and k the same tensor": (ValueError, "same memory",
                                lambda q, k, t, c, s, p: dict(q=q, k=q, cos=c, sin=s)),
}


@pytest.mark.parametrize("fn", [apply_rope, apply_rope_inplace], ids=["apply_rope", "inplace"])
@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_raise_on_the_host_and_leave_the_context_usable(name, fn):
    """Each bad call raises the documented exception with its message, changes nothing (also in
    place), and a valid call afterwards still works."""
    exc, match, build = ERRORS[name]
    kwargs = build(*_error_setup())
    tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    saved = _snapshot(*tensors)
    q = kwargs.pop("q")
    k = kwargs.pop("k", None)
    with pytest.raises(exc, match=match):
        fn(q, k, **kwargs)
    torch.cuda.synchronize()
    for t, before in saved:
        assert _same_bits(t, before)
    _valid_call_still_works()


def test_errors_do_not_poison_later_calls_of_the_same_shape():
    """A geometry whose first call failed its position check works on the next, valid call."""
    q, k, _, cos, sin, pos = _error_setup()
    with pytest.raises(IndexError):
        apply_rope(q, k, cos=cos, sin=sin, positions=_past_ids(pos))
    case = RopeCase(2, 16, 4, 32, kv_heads=2, positions="ids", max_position=ROWS, label="errors")
    inputs = make_inputs(case, 7, DEV)
    outs = apply_rope(q, k, cos=cos, sin=sin, positions=pos)
    _assert_matches_oracle(case, inputs, outs)


# ---- unchecked positions (kept last: it reads table rows the caller did not validate) ------------
def test_unchecked_positions_are_clamped_to_the_table():
    """check_positions=False with positions outside [0, L): the docstring promises the kernel
    clamps rows ("a bad position is wrong, never out of bounds"). The table is a window of a
    larger buffer filled with a sentinel, so a kernel that does not clamp reads the sentinel
    (a wrong result here) rather than faulting."""
    case = RopeCase(2, 16, 4, 32, kv_heads=2, positions="ids", max_position=ROWS, label="clamp")
    inputs = make_inputs(case, 11, DEV)
    pad = 64
    big_c = torch.full((ROWS + 2 * pad, 32), 7.0, device=DEV)
    big_s = torch.full((ROWS + 2 * pad, 32), -7.0, device=DEV)
    big_c[pad:pad + ROWS], big_s[pad:pad + ROWS] = inputs.cos, inputs.sin
    cos, sin = big_c[pad:pad + ROWS], big_s[pad:pad + ROWS]
    pos = inputs.positions.clone()
    pos[0, :3] = torch.tensor([ROWS, ROWS + 5, -3])
    outs = apply_rope(*inputs.xs, cos=cos, sin=sin, positions=pos, check_positions=False)
    clamped = dataclasses.replace(inputs, positions=pos.clamp(0, ROWS - 1))
    _assert_matches_oracle(case, clamped, outs)
