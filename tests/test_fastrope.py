"""fastrope's host side, without a GPU: argument checks, the validated problem, the launch plan,
the ablations, the registry entries and the suites that run the kernel.

``apply_rope`` promises that every bad argument raises on the host, before any launch (a kernel
fault would poison the CUDA context). The dtype, rank, layout and style checks come before the
device check, so plain CPU tensors reach them. The checks after the device check (rotary_dim,
positions/offsets, cos/sin, cu_seqlens, k, the position range) are reached with
:class:`FakeCuda`: CPU tensors that report ``is_cuda``. A fixture replaces every launch-side
entry point (plan, prepare, launch, SM count) with one that fails the test, so a check that
moved behind a launch, or went missing, fails here instead of touching a device.
"""
from __future__ import annotations

import functools
import inspect
import pathlib
import re
import types

import pytest
import torch

from ports import registry
from ports.harness.suites import get_suite
from ports.fastrope import ablation, kernel, launcher, plan, problem, run
from ports.fastrope import MODULE, apply_rope, apply_rope_inplace
from ports.fastrope.plan import Rule
from reference.case import RopeCase

ENTRY_POINTS = [apply_rope, apply_rope_inplace]
ENTRY_IDS = ["apply_rope", "apply_rope_inplace"]
FASTROPE_NAMES = {"fastrope.rope", "fastrope.rope_computed", "fastrope.rope_inplace"}
CHOOSE = plan.choose_from  # the real planner and packer, kept before the no_launch fixture
PREPARE = launcher.prepare  # replaces them
LAUNCH = launcher.launch
H100_L2_BYTES = 50 * 2**20  # torch's L2_cache_size on an H100


class FakeCuda(torch.Tensor):
    """A CPU tensor that claims to be a CUDA tensor, so the host checks after the device check
    run on this GPU-less machine. Used only where a check must raise before any launch."""

    is_cuda = property(lambda self: True)


def fake(t: torch.Tensor) -> FakeCuda:
    return t.as_subclass(FakeCuda)


def rand(*shape, dtype=torch.float32) -> torch.Tensor:
    """Fresh random values (never zeros)."""
    return (torch.randn(*shape) + 0.5).to(dtype)


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any attempt to plan, compile or launch is a test failure (the checks come first)."""
    def refuse(*args, **kwargs):
        raise AssertionError("reached the launch side: the host checks should have raised first")

    for module, name in ((plan, "choose_from"), (plan, "sm_count"), (plan, "l2_bytes"),
                         (launcher, "prepare"), (launcher, "launch")):
        monkeypatch.setattr(module, name, refuse)


# ---- checks before the device check: plain CPU tensors -------------------------------------------
@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=ENTRY_IDS)
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
def test_cpu_tensor_is_refused(fn, layout):
    """A well-formed CPU q is refused with a message naming the device."""
    with pytest.raises(ValueError, match="q must be a CUDA tensor, got a tensor on cpu"):
        fn(rand(2, 4, 3, 8), layout=layout)


def test_cpu_thd_tensor_is_refused():
    q = rand(6, 2, 8)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        apply_rope(q, layout="thd", cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32))


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=ENTRY_IDS)
@pytest.mark.parametrize("dtype,name", [(torch.int64, "int64"), (torch.int32, "int32"),
                                        (torch.float64, "float64"), (torch.bool, "bool")])
def test_wrong_dtype_is_a_type_error(fn, dtype, name):
    """Integer, bool and fp64 inputs: TypeError naming the dtype and the supported ones."""
    q = torch.randint(1, 5, (2, 4, 3, 8)).to(dtype)
    with pytest.raises(TypeError, match=f"q has dtype {name}; apply_rope supports float32, "
                                        "float16 and bfloat16"):
        fn(q)


@pytest.mark.parametrize("q", [[[1.0, 2.0]], 3.0, None], ids=["list", "float", "None"])
def test_non_tensor_is_a_type_error(q):
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        apply_rope(q)


@pytest.mark.parametrize("layout,shape,rank", [
    ("bshd", (2, 4, 8), 4), ("sbhd", (2, 4, 3, 8, 1), 4), ("bhsd", (8,), 4),
    ("thd", (2, 4, 3, 8), 3), ("thd", (8, 16), 3),
])
def test_wrong_rank_is_a_value_error(layout, shape, rank):
    """The message gives the expected rank, the layout's dims and the shape received."""
    with pytest.raises(ValueError, match=rf"q must be {rank}-D \[.*\] for layout '{layout}', "
                                         rf"got shape \({shape[0]},"):
        apply_rope(rand(*shape), layout=layout)


@pytest.mark.parametrize("layout", ["BSHD", "bsdh", "tdh", ""])
def test_bad_layout_string(layout):
    with pytest.raises(ValueError, match=r"unknown layout .*expected one of .*'bshd'"):
        apply_rope(rand(2, 4, 3, 8), layout=layout)


@pytest.mark.parametrize("style", ["neox", "gptj", "rotate-half", "Interleaved"])
def test_bad_style_string(style):
    with pytest.raises(ValueError, match=r"unknown style .*expected one of .*'rotate_half'"):
        apply_rope(rand(2, 4, 3, 8), style=style)


def test_layout_is_checked_before_the_tensor():
    """Layout and style strings are checked first: even a non-tensor q gets the layout error."""
    with pytest.raises(ValueError, match="unknown layout"):
        apply_rope("not a tensor", layout="nope")


# ---- checks after the device check: FakeCuda -----------------------------------------------------
def test_fake_cuda_reaches_past_the_device_check():
    """Guard for the tests below: FakeCuda really passes the device check (a plain CPU tensor
    with the same bad rotary_dim stops at the device check instead)."""
    q = rand(2, 4, 3, 8)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        apply_rope(q, rotary_dim=7)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rope(fake(q), rotary_dim=7)


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=ENTRY_IDS)
@pytest.mark.parametrize("rotary_dim", [7, 1, 10, 16, 0, -2, 4.0, "8"])
def test_rotary_dim_odd_too_large_or_not_an_int(fn, rotary_dim):
    """head_dim is 8: odd, > 8, <= 0 and non-int rotary_dims are refused."""
    with pytest.raises(ValueError, match=r"rotary_dim must be even and in \(0, head_dim=8\]"):
        fn(fake(rand(2, 4, 3, 8)), rotary_dim=rotary_dim)


@pytest.mark.parametrize("offsets", [3, torch.tensor([1, 2])], ids=["int", "tensor"])
def test_positions_and_offsets_together(offsets):
    q = fake(rand(2, 4, 3, 8))
    positions = torch.randint(0, 4, (2, 4))
    with pytest.raises(ValueError, match="not both"):
        apply_rope(q, positions=positions, offsets=offsets)


@pytest.mark.parametrize("which", ["cos", "sin"])
def test_cos_without_sin(which):
    table = rand(16, 8)
    with pytest.raises(ValueError, match="pass both cos and sin, or neither"):
        apply_rope(fake(rand(2, 4, 3, 8)), **{which: table})


def test_last_dim_must_be_contiguous():
    q = fake(rand(2, 4, 3, 16)[..., ::2])
    with pytest.raises(ValueError, match=r"last dimension must be contiguous .*\.contiguous\(\)"):
        apply_rope(q)


def test_k_must_match_q():
    q = fake(rand(2, 4, 3, 8))
    with pytest.raises(TypeError, match="k has dtype"):
        apply_rope(q, fake(rand(2, 4, 3, 8, dtype=torch.float16)))
    with pytest.raises(ValueError, match="must match in every dimension but heads"):
        apply_rope(q, fake(rand(2, 5, 3, 8)))
    with pytest.raises(ValueError, match="must match in every dimension but heads"):
        apply_rope(q, fake(rand(2, 4, 3, 6)))
    with pytest.raises(ValueError, match="same memory"):
        apply_rope(q, q)
    with pytest.raises(ValueError, match="k must be 4-D"):
        apply_rope(q, fake(rand(8, 3, 8)))


def test_thd_needs_well_formed_cu_seqlens():
    q = fake(rand(6, 2, 8))
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        apply_rope(q, layout="thd")
    for bad in (torch.tensor([0, 2, 6]),                             # int64
                torch.tensor([6], dtype=torch.int32),                 # one entry
                torch.tensor([[0, 6]], dtype=torch.int32),            # 2-D
                [0, 2, 6]):                                           # not a tensor
        with pytest.raises(ValueError, match="cu_seqlens must be"):
            apply_rope(q, layout="thd", cu_seqlens=bad)
    with pytest.raises(ValueError, match="only apply to layout 'thd'"):
        apply_rope(fake(rand(2, 3, 2, 8)), cu_seqlens=torch.tensor([0, 3], dtype=torch.int32))


@pytest.mark.parametrize("cu", [[0, 2, 5], [0, 2, 7], [1, 2, 6], [0, 4, 2, 6]])
def test_cu_seqlens_must_rise_from_zero_to_t(cu):
    q = fake(rand(6, 2, 8))
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to t = 6"):
        apply_rope(q, layout="thd", cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                   cos=rand(16, 8), sin=rand(16, 8))


def test_position_tensors_are_checked():
    q = fake(rand(2, 4, 3, 8))
    with pytest.raises(TypeError, match="positions must be int32 or int64"):
        apply_rope(q, positions=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="positions must have shape"):
        apply_rope(q, positions=torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="offsets must be int32 or int64"):
        apply_rope(q, offsets=torch.zeros(2))
    with pytest.raises(ValueError, match="offsets must have shape"):
        apply_rope(q, offsets=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="offsets must be an int or an int tensor"):
        apply_rope(q, offsets=1.5)


def test_tables_are_checked():
    q = fake(rand(2, 4, 3, 8))
    with pytest.raises(TypeError, match="cos has dtype int64"):
        apply_rope(q, cos=torch.ones(16, 8, dtype=torch.int64), sin=rand(16, 8))
    with pytest.raises(TypeError, match="sin has dtype float64"):
        apply_rope(q, cos=rand(16, 8), sin=rand(16, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"cos must be \[max_position, rotary_dim=8\]"):
        apply_rope(q, cos=rand(16, 6), sin=rand(16, 6))
    with pytest.raises(ValueError, match=r"must be \[max_position"):
        apply_rope(q, cos=rand(16, 8, 1), sin=rand(16, 8, 1))
    with pytest.raises(ValueError, match="must match"):
        apply_rope(q, cos=rand(16, 8), sin=rand(16, 4))
    with pytest.raises(ValueError, match="must match"):
        apply_rope(q, cos=rand(16, 8), sin=rand(16, 8, dtype=torch.float16))


def test_computed_angle_arguments_are_checked():
    q = fake(rand(2, 4, 3, 8))
    with pytest.raises(ValueError, match="inv_freq must be a tensor"):
        apply_rope(q, inv_freq=torch.ones(8, dtype=torch.float64))
    for base in (0.0, -10.0, float("nan")):
        with pytest.raises(ValueError, match="base must be positive"):
            apply_rope(q, base=base)


@pytest.mark.parametrize("kwargs,lo_hi", [
    (dict(), "[0, 4]"),                                              # arange, seqlen 5 > 4 rows
    (dict(offsets=1), "[1, 5]"),
    (dict(offsets=-1), "[-1, 3]"),
    (dict(offsets=torch.tensor([0, 2])), "[0, 6]"),
    (dict(positions=torch.tensor([[0, 1, 2, 3, 3], [0, 1, 2, 3, 9]])), "[0, 9]"),
    (dict(positions=torch.tensor([0, 1, -2, 3, 3], dtype=torch.int32)), "[-2, 3]"),
])
def test_positions_past_the_table_raise_index_error(kwargs, lo_hi):
    """Every position must index a row of the 4-row table; the message gives the range."""
    q = fake(rand(2, 5, 3, 8))
    with pytest.raises(IndexError, match=re.escape(f"positions reach {lo_hi} but cos/sin have "
                                                   "4 rows")):
        apply_rope(q, cos=rand(4, 8), sin=rand(4, 8), **kwargs)


def test_thd_longest_sequence_past_the_table():
    q = fake(rand(7, 2, 8))
    cu = torch.tensor([0, 2, 7], dtype=torch.int32)  # the longest sequence has 5 tokens
    with pytest.raises(IndexError, match=r"positions reach \[0, 4\] but cos/sin have 4 rows"):
        apply_rope(q, layout="thd", cu_seqlens=cu, cos=rand(4, 8), sin=rand(4, 8))


# ---- the validated problem -----------------------------------------------------------------------
ARGUMENTS = dict(k=None, cos=None, sin=None, positions=None, offsets=None, cu_seqlens=None,
                 max_seqlen=None, style="rotate_half", layout="bshd", rotary_dim=None,
                 base=10000.0, inv_freq=None)


def _validate(q, **changes):
    return problem.validate(q=q, **dict(ARGUMENTS, **changes))


def test_validate_sums_up_the_call():
    """One keyword-only frozen Problem per call, its fields read off the arguments."""
    q = fake(rand(2, 5, 3, 16))
    cos, sin = rand(8, 8), rand(8, 8)
    ids = torch.zeros(2, 5, dtype=torch.int32)
    p = _validate(q, k=fake(rand(2, 5, 1, 16)), cos=cos, sin=sin, positions=ids,
                  style="interleaved", rotary_dim=8)
    assert (p.layout, p.interleaved, p.batch, p.seqlen, p.head_dim, p.rotary_dim) == (
        "bshd", True, 2, 5, 16, 8)
    assert not p.computed and p.table_dtype == torch.float32 and p.table_rows == 8
    assert p.table_stride == 8 and not p.tables_need_copy and not p.half_table
    assert p.positions == problem.Positions.IDS and p.position_strides == (5, 1)
    assert p.position_int32
    assert p.default_inv_freq is None and p.nseq == 0
    with pytest.raises(TypeError):
        problem.Problem(**{f: getattr(p, f) for f in problem.Problem.__dataclass_fields__}, x=1)
    with pytest.raises(TypeError, match="positional"):
        problem.Problem("bshd")
    with pytest.raises(AttributeError):
        p.batch = 3


def test_validate_computed_angles_and_packed_sequences():
    q = fake(rand(7, 2, 8))
    cu = torch.tensor([0, 2, 7], dtype=torch.int32)
    p = _validate(q, layout="thd", cu_seqlens=cu, offsets=torch.tensor([0, 4]))
    assert p.computed and p.table_dtype is None and p.nseq == 2 and (p.batch, p.seqlen) == (1, 7)
    assert p.positions == problem.Positions.OFFSETS and p.position_strides == (1, 0)
    assert p.default_inv_freq.dtype == torch.float64 and p.default_inv_freq.shape == (4,)
    half = _validate(fake(rand(2, 5, 3, 16)), cos=rand(8, 8).t().contiguous().t(),
                     sin=rand(8, 8), offsets=3)
    assert half.tables_need_copy and half.table_stride == 8 and half.half_table
    assert half.positions == problem.Positions.ARANGE


def test_input_key_tells_directions_and_in_place_apart():
    q = fake(rand(2, 5, 3, 16)).as_subclass(torch.Tensor)  # a plain tensor: cacheable
    key = functools.partial(problem.input_key, q=q, **ARGUMENTS)
    assert key(extra=(False, False)) == key(extra=(False, False))
    assert key(extra=(False, False)) != key(extra=(True, False))
    assert key(extra=(False, True)) != key(extra=(False, False))
    assert problem.input_key(q=fake(q), extra=None, **ARGUMENTS) is None  # subclass: no cache



def _fields(p) -> tuple:
    """A Problem's fields, the default frequencies by presence (a tensor has no plain ==)."""
    return tuple(getattr(p, f) if f != "default_inv_freq" else getattr(p, f) is None
                 for f in problem.Problem.__dataclass_fields__)


def test_one_key_is_one_problem():
    """Calls that share a cache key validate to the same problem, over the tables' forms, the
    position forms (ids of either width and rank, an int offset, an offsets tensor, cu_seqlens),
    both styles, partial rotary, both dense layouts of one shape, thd, and a GQA k: a shared key
    would run one call with another's plan."""
    q, k = rand(4, 4, 2, 16), rand(4, 4, 1, 16)  # b == s: [s] ids and [b] offsets look alike
    four = torch.tensor([3, 0, 2, 1])
    tables = {"full": dict(cos=rand(8, 16), sin=rand(8, 16)),
              "half": dict(cos=rand(8, 8), sin=rand(8, 8)), "computed": {},
              "inv_freq": dict(inv_freq=torch.rand(8, dtype=torch.float64))}
    positions = {"arange": {}, "ids": dict(positions=four), "ids32": dict(positions=four.int()),
                 "ids2d": dict(positions=four.expand(4, 4)), "int": dict(offsets=2),
                 "offsets": dict(offsets=four), "offsets32": dict(offsets=four.int())}
    calls = [dict(q=q, k=kk, style=style, layout=layout, rotary_dim=rot, **t, **pos)
             for style in ("rotate_half", "interleaved") for layout in ("bshd", "sbhd")
             for rot in (None, 8) for t in tables.values() for pos in positions.values()
             for kk in (None, k)]
    packed, ids5 = rand(5, 2, 16), torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)  # as cu
    calls += [dict(q=packed, layout="thd", cu_seqlens=torch.tensor(cu, dtype=torch.int32), **t)
              for cu in ([0, 2, 5], [0, 1, 2, 4, 5]) for t in (tables["full"], {})]
    calls += [dict(q=packed, layout="thd", positions=ids5, max_seqlen=5, **t)
              for t in (tables["full"], {})]
    seen: dict = {}
    for call in calls:
        arguments = dict(ARGUMENTS, **call)
        key = problem.input_key(extra=None, **arguments)
        assert key is not None
        wrapped = dict(arguments, q=fake(arguments["q"]),
                       k=None if arguments["k"] is None else fake(arguments["k"]))
        try:
            fields = _fields(problem.validate(**wrapped))
        except (ValueError, TypeError, IndexError):
            continue
        assert seen.setdefault(key, fields) == fields, {  # the call, tensors by metadata
            name: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
            for name, v in call.items()}
    assert len(seen) > 200

# ---- ablations -----------------------------------------------------------------------------------
def test_public_functions_take_no_ablation():
    for fn in ENTRY_POINTS:
        with pytest.raises(TypeError, match="ablation"):
            fn(fake(rand(2, 4, 3, 8)), ablation="one_head_per_step")
    params = inspect.signature(run.rotate).parameters
    assert "tuning" not in params and "ablation" not in params


@pytest.mark.parametrize("fn", [ablation.apply_rope, ablation.apply_rope_inplace],
                         ids=["apply_rope", "apply_rope_inplace"])
def test_ablation_functions_check_like_the_public_ones(fn):
    """The ablation entry points run the same host checks, and want a known ablation."""
    with pytest.raises(ValueError, match="CUDA tensor"):
        fn(rand(2, 4, 3, 8), ablation="one_head_per_step")
    with pytest.raises(ValueError, match="rotary_dim"):
        fn(fake(rand(2, 4, 3, 8)), rotary_dim=7, ablation="scalar_access")
    with pytest.raises(ValueError, match="unknown ablation 'unroll'"):
        fn(fake(rand(2, 4, 3, 8)), ablation="unroll")
    with pytest.raises(TypeError, match="ablation must be a name"):
        fn(fake(rand(2, 4, 3, 8)), ablation=dict(unroll=1))


def test_every_registry_ablation_is_a_named_ablation():
    """Each fastrope-ablation.* row but full_tables (the design, given [L, R] tables) runs the
    ablation of its name."""
    rows = {s.name.split(".", 1)[1] for s in registry.select(["fastrope-ablation"])}
    assert rows - {"full_tables"} <= set(ablation.ABLATIONS)


@pytest.fixture
def recorded_launches(monkeypatch):
    """The real planner and packer with the device side faked (132 SMs, no compile, no launch):
    the list of Launches that calls make."""
    launches = []
    monkeypatch.setattr(plan, "choose_from", CHOOSE)
    monkeypatch.setattr(plan, "sm_count", lambda index: 132)
    monkeypatch.setattr(plan, "l2_bytes", lambda index: H100_L2_BYTES)
    monkeypatch.setattr(plan, "device_rules", lambda index: plan.RULES)
    monkeypatch.setattr(launcher, "prepare", PREPARE)
    monkeypatch.setattr(kernel, "function_ptr", lambda device, name: 1)
    monkeypatch.setattr(launcher, "_driver", lambda: types.SimpleNamespace(
        launchKernel=None, ctxGetCurrent=None, ctxSetCurrent=None))
    monkeypatch.setattr(launcher, "primary_context", lambda device: 0)
    monkeypatch.setattr(launcher, "launch", lambda lc, *pointers: launches.append(lc))
    return launches


def test_ablations_reach_the_launch(recorded_launches):
    """The public call runs the design; the ablation calls change only what their rules say,
    and each ablation gets its own cached launches."""
    q, k = fake(rand(2, 16, 4, 64)), fake(rand(2, 16, 2, 64))
    tables = dict(cos=rand(16, 64), sin=rand(16, 64))
    apply_rope(q, k, **tables)
    (design,) = recorded_launches
    assert design.plan.step and design.plan.vector == 4
    ablation.apply_rope(q, k, ablation="divmod_index", **tables)
    tuned = recorded_launches[-1].plan
    # given tables: a thread owns both halves; data this small stays in the L2: plain accesses
    flags = kernel.FLAT_INDEX | kernel.PAIR_PER_THREAD | kernel.PLAIN_ACCESSES
    assert not tuned.step and tuned.kernel.endswith(f", 1, {flags}>")
    assert tuned.vector == design.plan.vector
    recorded_launches.clear()
    ablation.apply_rope_inplace(q, k, ablation="separate_launches", **tables)
    assert len(recorded_launches) == 2  # q and k in two launches
    recorded_launches.clear()
    apply_rope(q, k, **tables)
    assert [lc.plan for lc in recorded_launches] == [design.plan]


@pytest.mark.parametrize("current", [7, 0, 9], ids=["its context", "none", "another"])
def test_launch_makes_the_devices_context_current(monkeypatch, current):
    """The launch runs in the device's primary context (7 here): switched to when the thread's
    current context differs (none, or another device's), and switched back afterwards."""
    calls = []
    state = {"current": current}

    def set_context(ctx):
        calls.append(("set", ctx))
        state["current"] = ctx

    def launch_kernel(*args):
        calls.append(("launch", state["current"]))

    monkeypatch.setattr(launcher, "_current_raw_stream", lambda device: 0)
    lc = launcher.Launch(1, (1, 1, 1), (1, 1, 1), 0, bytes(launcher._STATIC.size), 0, None,
                         (1, 1, 1, 1, 1, 1, 0), 7, launch_kernel, lambda: state["current"],
                         set_context)
    LAUNCH(lc, *range(10))
    if current == 7:
        assert calls == [("launch", 7)]
    else:
        assert calls == [("set", 7), ("launch", 7), ("set", current)]


def test_one_gradient_for_both_outputs_is_accepted(recorded_launches):
    """autograd may hand the same tensor as dq and dk (backward([q_out, k_out], [g, g])): the
    inverse rotation copies k's, where a forward call refuses q and k in one memory."""
    g = fake(rand(2, 16, 4, 64))
    tables = dict(cos=rand(16, 64), sin=rand(16, 64))
    with pytest.raises(ValueError, match="same memory"):
        run.rotate(g, g, in_place=False, **tables)
    run.rotate(g, g, in_place=False, inverse=True, **tables)
    assert len(recorded_launches) == 1


def test_ablation_rows_come_before_the_design():
    """An ablation's rows go first, so they win every setting they give; the default row gives
    every setting a table decides."""
    assert ablation.rules(ablation.ABLATIONS["int64_index"])[1:] == plan.RULES
    default = plan.RULES[-1]
    for a in ablation.ABLATIONS.values():
        for rule in a.rules:
            assert set(rule.settings) <= set(default.settings), a.name
    with pytest.raises(ValueError, match="step heads"):
        ablation.step_heads(0)


def _flags(p) -> int:
    """The FLAGS template argument of a plan's kernel."""
    args = p.kernel[p.kernel.index("<") + 1:-1].split(", ")
    return int(args[4] if p.step else args[7])


@pytest.mark.parametrize("shape, in_place, hints", [
    ((1, 4096, 32, 128), True, False),    # 32 MiB, read and written in place
    ((1, 6400, 32, 128), True, False),    # 50 MiB: the L2 exactly
    ((1, 6401, 32, 128), True, True),
    ((1, 4096, 32, 128), False, True),    # 32 MiB in, 32 MiB out
    ((64, 1, 32, 128), False, False),     # a decode step (the step kernel)
], ids=["32MiB-inplace", "50MiB-inplace", "over-50MiB-inplace", "64MiB-out-of-place", "decode"])
def test_streaming_hints_only_where_the_data_outgrows_the_l2(monkeypatch, shape, in_place, hints):
    """Evict-first accesses only when the bytes the call reads and writes exceed the L2 (50 MiB
    here); the hints_at_every_size ablation keeps them at every size."""
    kw = dict(shape=shape, in_place=in_place, step_eligible=True)
    streaming = not _flags(_plan(monkeypatch, **kw)) & kernel.PLAIN_ACCESSES
    assert streaming == hints
    always = _plan(monkeypatch, **kw, hints_at_every_size=True)
    assert not _flags(always) & kernel.PLAIN_ACCESSES


def test_token_tile_divides_the_sequence_and_fits_the_block_and_grid():
    assert plan.token_tile(4096, 8, 8) == 8
    assert plan.token_tile(4100, 8, 8) == 4    # the largest that divides S
    assert plan.token_tile(4097, 8, 8) == 1    # none: a token a block
    assert plan.token_tile(64, 64, 8) == 4     # 64 chunk threads x 8 tokens: more than a block
    assert plan.token_tile(8 * 70000, 8, 8) == 1  # S / 8, / 4 and / 2 past grid.y
    assert plan.token_tile(4096, 8, 1) == 1    # the design: a token a block


def test_step_tile_runs_across_the_batch_in_sbhd_while_the_positions_fit_grid_z():
    assert plan.step_tile(4096, 3, 8, 8, across=False) == 8    # bshd: the tile divides S
    assert plan.step_tile(4096, 6, 8, 8, across=True) == 2     # across: the tile divides B
    assert plan.step_tile(4096, 3, 8, 8, across=True) == 1     # no tile divides B
    big = plan.MAX_GRID_Y + 1
    assert plan.step_tile(big, 8, 8, 8, across=True) == 1      # S past grid.z
    assert plan.step_tile(big - 1, 8, 8, 8, across=True) == 8


_OUT_TILES = "out of place from twice the L2: token tiles"
_IN_TILES = "in place from twice the L2: token tiles"


@pytest.mark.parametrize("row, alternative, in_place, plain, heads", [
    (_OUT_TILES, "the step kernel in tiles of 8 tokens", False, False, 1),
    (_OUT_TILES, "the step kernel in tiles of 8 tokens, plain accesses", False, True, 1),
    (_IN_TILES, "the step kernel in tiles of 8 tokens", True, False, 1),
    (_IN_TILES, "the step kernel in tiles of 8 tokens, 2 heads a thread", True, False, 2)])
def test_token_tiles_alternative(monkeypatch, row, alternative, in_place, plain, heads):
    """A tuning table's token-tiles alternative: inputs of at least twice the L2, in its row's
    mode, take the step kernel with head blocks first in the grid and 8 tokens a block, with the
    alternative's accesses and heads a thread; the other mode, an input below the bound, the
    interleaved style and the design (no table) keep their plans (here, small enough: the step
    kernel, a token a block)."""
    # the input: 2 x 64 tokens x 8 heads x 128 bf16 = 256 KiB, twice a 128 KiB L2
    kw = dict(shape=(2, 64, 6, 128), k_heads=2, tables_dtype=torch.bfloat16, l2=128 * 1024,
              step_eligible=True, step_switches=0, in_place=in_place)
    design = _plan(monkeypatch, **kw)
    assert design.grid == (64, 2, 2) and not _flags(design) & kernel.TOKEN_TILES
    assert not _flags(design) & kernel.PLAIN_ACCESSES
    others = (dict(in_place=not in_place), dict(l2=128 * 1024 + 1), dict(interleaved=True))
    others_design = [_plan(monkeypatch, **{**kw, **other}) for other in others]
    monkeypatch.setattr(plan, "RULES", plan.with_choices({row: alternative}))
    p = _plan(monkeypatch, **kw)
    # 8 heads of 8 chunk threads, 8 tokens: 4 head lanes a block (256 threads), 2 head blocks;
    # 2 heads a thread: 1 block (too little work here for the in-place rule's several heads)
    assert p.step and p.grid == (2 // heads, 64 // 8, 2) and p.block == (8, 4, 8)
    assert p.unroll == heads and _flags(p) & kernel.TOKEN_TILES
    assert bool(_flags(p) & kernel.PLAIN_ACCESSES) == plain
    for other, own in zip(others, others_design):
        assert _plan(monkeypatch, **{**kw, **other}) == own, other
    # a sequence no tile divides: the rows kernel (which every input this large takes on an
    # H100 or H200: past the step kernel's work bound)
    assert not _plan(monkeypatch, **{**kw, "shape": (2, 65, 6, 128)}).step
    # fp32: 16 chunk threads of 4 elements, 2 head lanes of 8 tokens a block
    p = _plan(monkeypatch, **{**kw, "dtype": torch.float32, "tables_dtype": torch.float32})
    assert p.step and p.grid == (4 // heads, 64 // 8, 2) and p.block == (16, 2, 8)


def test_in_place_token_tiles_from_4x_the_l2(monkeypatch):
    """The in-place alternative bounded at 4x the L2: the rows kernel from 2x to just under 4x,
    tiles from 4x, with 2 heads a thread in 16 bits and 1 in fp32."""
    monkeypatch.setattr(plan, "RULES", plan.with_choices({
        _IN_TILES: "the step kernel in tiles of 8 tokens from 4x the L2, 2 heads a thread in 16 "
                   "bits"}))
    # the input: 2 x 64 tokens x 8 heads x 128 bf16 = 256 KiB
    kw = dict(shape=(2, 64, 6, 128), k_heads=2, tables_dtype=torch.bfloat16, l2=64 * 1024 + 1,
              step_eligible=True, step_switches=0, in_place=True)
    assert not _plan(monkeypatch, **kw).step  # under 4x: the rows kernel
    p = _plan(monkeypatch, **{**kw, "l2": 64 * 1024})
    assert p.step and _flags(p) & kernel.TOKEN_TILES and p.unroll == 2
    p = _plan(monkeypatch, **{**kw, "l2": 64 * 1024, "dtype": torch.float32,
                              "tables_dtype": torch.float32})
    assert p.step and _flags(p) & kernel.TOKEN_TILES and p.unroll == 1


@pytest.mark.parametrize("batch, tile", [(2, 2), (6, 2), (8, 8), (16, 8), (3, 1)])
@pytest.mark.parametrize("in_place", [False, True])
def test_token_tiles_run_across_the_batch_in_sbhd(monkeypatch, batch, tile, in_place):
    """In sbhd with B > 1 the tiles run across the batch: grid (head blocks, B / tile, S), a
    block one position of ``tile`` sequences (consecutive in memory), BATCH_TILES set; a batch
    no tile divides takes the rows kernel."""
    row = _IN_TILES if in_place else _OUT_TILES
    # 64 tokens x 8 heads x 128 bf16 a sequence: 128 KiB, so the input is twice a 64 KiB x B L2
    kw = dict(shape=(batch, 64, 6, 128), k_heads=2, tables_dtype=torch.bfloat16,
              l2=64 * 1024 * batch, step_eligible=True, step_switches=0, in_place=in_place,
              layout="sbhd")
    design = _plan(monkeypatch, **kw)
    assert not _flags(design) & kernel.TOKEN_TILES
    monkeypatch.setattr(plan, "RULES",
                        plan.with_choices({row: "the step kernel in tiles of 8 tokens"}))
    p = _plan(monkeypatch, **kw)
    if tile == 1:  # the rows kernel, in memory order
        assert not p.step and p.fold == batch
        return
    lanes = min(8, 256 // (8 * tile))
    assert p.step and p.grid == (8 // lanes, batch // tile, 64) and p.block == (8, lanes, tile)
    assert _flags(p) & kernel.TOKEN_TILES and _flags(p) & kernel.BATCH_TILES
    # bshd: the tiles run along the sequence, BATCH_TILES off
    q = _plan(monkeypatch, **{**kw, "layout": "bshd"})
    assert q.grid[1:] == (64 // 8, batch) and not _flags(q) & kernel.BATCH_TILES


def test_compile_checked_instantiations_cover_the_kernel():
    """MODULE (what the sm_90 compile test builds) holds every dtype, style, angle source and
    FLAGS bit, 64-bit offsets, and the step kernel's switches."""
    names = MODULE.kernels
    assert names == kernel.COMPILE_CHECKED and len(set(names)) == len(names)
    step = [n[n.index("<") + 1:-1].split(", ") for n in names if n.startswith("rope_step<")]
    # rope_step<T, TT, V, INTERLEAVED, FLAGS, HEADS, SWITCHES>: every element type and both
    # styles; every switch compiled in, and the switches read at run time
    assert {a[0] for a in step} == set(kernel.CTYPE.values())
    assert {a[3] for a in step} == {"false", "true"}
    switches = {int(a[6]) for a in step}
    assert kernel.RUNTIME_SWITCHES in switches
    assert all(any(sw >= 0 and sw & bit for sw in switches) for bit in (1, 2, 4, 8, 16))
    assert any(int(a[4]) & kernel.TOKEN_TILES for a in step)  # the step kernel's own bit
    # rope_rows<T, TT, V, INTERLEAVED, COMPUTED, IDX, UNROLL, FLAGS>
    args = [n[n.index("<") + 1:-1].split(", ") for n in names if n.startswith("rope_rows<")]
    assert {a[0] for a in args} == set(kernel.CTYPE.values())
    assert {(a[3], a[4]) for a in args} == {(i, c) for i in ("false", "true")
                                            for c in ("false", "true")}
    assert {a[5] for a in args} == {"int", "long long"}
    for flag in (kernel.TABLE_PER_HEAD, kernel.PLAIN_ACCESSES, kernel.FP32_ANGLES,
                 kernel.FLAT_INDEX, kernel.PAIR_PER_THREAD):
        assert any(int(a[7]) & flag for a in args), flag


# ---- the vector width ---------------------------------------------------------------------------
def _vw(elem=2, units=(64,), strides=(8192, 512, 128), addresses=(0x10000, 0x20000),
        table_elem=4, per_chunk=lambda v: v, table_stride=128, table_address=0x30000,
        minimum=1):
    return plan.vector_width(elem, tuple(units), tuple(strides), tuple(addresses), table_elem,
                                per_chunk, table_stride, table_address, minimum)


def test_aligned_bf16_gets_16_byte_accesses():
    """bf16, R/2 = 64 (% 8 == 0), aligned tensors and fp32 tables: V = 8 (16 bytes)."""
    assert _vw() == 8
    assert _vw(units=(8,)) == 8
    assert _vw(table_elem=2) == 8                 # bf16 tables
    assert _vw(table_elem=0, per_chunk=lambda v: 1, table_stride=1, table_address=0) == 8
    assert _vw(elem=4) == 4                       # fp32: 4 x 4 bytes


@pytest.mark.parametrize("units,want", [((12,), 4), ((46,), 2), ((23,), 1), ((64, 12), 4),
                                        ((64, 2), 2), ((64, 1), 1)])
def test_rotary_or_tail_not_divisible_narrows_the_vector(units, want):
    assert _vw(units=units) == want


@pytest.mark.parametrize("stride,want", [(8196, 4), (8194, 2), (8193, 1), (644, 4), (93, 1)])
def test_odd_strides_narrow_the_vector(stride, want):
    assert _vw(strides=(stride, 512, 128)) == want


@pytest.mark.parametrize("offset,want", [(8, 4), (4, 2), (2, 1)])
def test_misaligned_addresses_narrow_the_vector(offset, want):
    assert _vw(addresses=(0x10000, 0x20000 + offset)) == want


@pytest.mark.parametrize("table_address,table_stride,want", [
    (0x30000 + 8, 128, 2),    # 8-byte aligned rows: 2 fp32 table elements per access
    (0x30000 + 4, 128, 1),
    (0x30000, 132, 4),        # row stride only divisible by 4
    (0x30000, 129, 1),
])
def test_table_alignment_narrows_the_vector(table_address, table_stride, want):
    assert _vw(table_address=table_address, table_stride=table_stride) == want


def test_interleaved_needs_pairs_in_one_access():
    """With minimum 2 (interleaved) a layout that only allows V = 1 gives 0; V = 2 still works."""
    inter = dict(units=(128,), minimum=2)
    assert _vw(**inter) == 8
    assert _vw(strides=(8193, 512, 128), **inter) == 0
    assert _vw(addresses=(0x10000, 0x20002), **inter) == 0
    assert _vw(elem=4, strides=(8193, 512, 128), **inter) == 0
    assert _vw(strides=(8194, 512, 128), **inter) == 2
    # one-angle-per-pair tables read V/2 elements per chunk
    assert _vw(per_chunk=lambda v: v // 2, table_stride=64, **inter) == 8


@pytest.mark.parametrize("seed", range(20))
def test_vector_width_satisfies_every_constraint(seed):
    """Random problems: the chosen V is a power of two of at most 16 bytes that divides every
    unit and stride and aligns every address; a wider V would break one of those."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=g))]
    elem = pick(2, 4)
    units = (pick(64, 46, 24, 12, 8, 3),)
    strides = tuple(pick(8192, 8194, 8196, 4100, 129, 6) for _ in range(3))
    addresses = tuple(0x10000 + pick(0, 2, 4, 8, 16) * (elem // 2) for _ in range(2))
    v = _vw(elem=elem, units=units, strides=strides, addresses=addresses, table_elem=0,
            per_chunk=lambda v: 1, table_stride=1, table_address=0)

    def ok(v):
        return (all(u % v == 0 for u in units) and all(s % v == 0 for s in strides)
                and all(a % (v * elem) == 0 for a in addresses))

    assert v >= 1 and v & (v - 1) == 0 and v * elem <= 16
    assert ok(v)
    assert 2 * v * elem > 16 or not ok(2 * v)


# ---- the plan (sm count faked) ------------------------------------------------------------------
def _plan(monkeypatch, shape=(2, 16, 4, 128), dtype=torch.bfloat16, rotary_dim=None, k_heads=None,
          interleaved=False, computed=False, in_place=False, src_strides=None,
          tables_dtype=torch.float32, l2=H100_L2_BYTES, step_eligible=False, step_switches=None,
          layout="bshd", **changes):
    """The plan of a bshd (or sbhd) problem ``shape`` (b, s, h, d). ``step_eligible=False``
    keeps the step kernel off (the caller's conditions unmet); ``step_switches``
    (kernel.step_switches) gives the position form, id width, table width and direction (None:
    read at run time, the runtime_switches ablation); ``changes``: rules put before the design's
    (:func:`_rows`)."""
    monkeypatch.setattr(plan, "sm_count", lambda index: 132)
    monkeypatch.setattr(plan, "l2_bytes", lambda index: l2)
    b, s, h, d = shape
    rot = d if rotary_dim is None else rotary_dim
    ops = []
    for heads in (h,) + ((k_heads,) if k_heads else ()):
        x = (rand(b, s, heads, d, dtype=dtype) if layout == "bshd"
             else rand(s, b, heads, d, dtype=dtype).transpose(0, 1))
        out = x if in_place else torch.empty_like(x)
        st = lambda t: (t.stride(0), t.stride(1), t.stride(2))
        ops.append(plan.Operand(x, out, heads, src_strides or st(x), st(out)))
    sw = 0 if step_switches is None else step_switches
    cos, sin = (None, None) if computed else (rand(s, rot).to(tables_dtype),
                                              rand(s, rot).to(tables_dtype))
    p = problem.Problem(
        layout=layout, interleaved=interleaved, batch=b, seqlen=s, head_dim=d, rotary_dim=rot,
        computed=computed, table_dtype=None if computed else tables_dtype,
        table_rows=0 if computed else s, table_stride=0 if computed else rot,
        tables_need_copy=False, half_table=bool(sw >> 3 & 1), default_inv_freq=None,
        positions=problem.Positions(sw & 3), position_strides=(0, 0),
        position_int32=bool(sw >> 2 & 1), nseq=0, max_seqlen=None)
    rows = _rows(**changes)
    if not step_eligible:
        rows += (Rule("test: step kernel off", "", plan.always, dict(step_kernel=False)),)
    if step_switches is None:
        rows += (Rule("test: switches at run time", "", plan.always,
                      dict(fixed_switches=False)),)
    return CHOOSE(rows + plan.RULES, p, ops, in_place=in_place, backward=bool(sw >> 4 & 1),
                  cos=cos, sin=sin)


# The ablations _plan's keywords name (ablation.ABLATIONS), and the settings of the others.
_NAMED = {("shape_rule", "fixed"): "fixed_launch", ("index_bits", 64): "int64_index",
          ("step_kernel", False): "no_step_kernel", ("memory_order", False):
          "sequence_per_block_row", ("one_half_per_thread", True): "one_half_per_thread",
          ("hints_at_every_size", True): "hints_at_every_size",
          ("runtime_switches", True): "runtime_switches", ("flags", kernel.FLAT_INDEX):
          "divmod_index"}


def _rows(vector_cap=None, unroll=None, step_heads=None, **named) -> tuple:
    rows = ()
    for item in named.items():
        rows += ablation.ABLATIONS[_NAMED[item]].rules
    if step_heads is not None:
        rows += ablation.step_heads(step_heads).rules
    settings = {}
    if vector_cap is not None:
        settings.update(vector_cap=vector_cap, vector=None, unroll=plan.unroll_from_work)
    if unroll is not None:
        settings.update(unroll=unroll, vector=None, step_kernel=False)
    if settings:
        rows += (Rule("test: fixed vector or heads per step", "", plan.always, settings),)
    return rows


def test_kernel_name_is_the_template_instantiation():
    assert (kernel.kernel_name(torch.bfloat16, torch.float32, 8, False, True, 32, 4)
            == "rope_rows<__nv_bfloat16, float, 8, false, true, int, 4, 0>")
    assert (kernel.kernel_name(torch.float16, torch.float16, 2, True, False, 64, 1, 5)
            == "rope_rows<__half, __half, 2, true, false, long long, 1, 5>")
    assert (kernel.step_kernel_name(torch.bfloat16, torch.float32, 8, False, kernel.PAIR_PER_THREAD,
                                    2, kernel.step_switches(2, True, False, True))
            == "rope_step<__nv_bfloat16, float, 8, false, 16, 2, 22>")


def test_step_switches_pack_rope_cu_step_args():
    """kernel.step_switches packs the bits rope.cu's StepArgs<SWITCHES> unpacks."""
    src = (pathlib.Path(kernel.__file__).parent / kernel.FILENAME).read_text()
    unpack = dict(re.findall(r"static constexpr int (\w+) = \(?SWITCHES( >> \d+)?\)? & 1?3?", src))
    assert unpack == {"positions": "", "position_int32": " >> 2", "half_table": " >> 3",
                      "backward": " >> 4"}
    assert [kernel.step_switches(m, *bits) for m, *bits in
            ((0, False, False, False), (2, False, False, False), (0, True, False, False),
             (0, False, True, False), (0, False, False, True))] == [0, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="positions"):
        kernel.step_switches(3, False, False, False)


def test_positions_are_encoded_once():
    """rope.cu's enum Positions spells problem.Positions' values."""
    src = (pathlib.Path(kernel.__file__).parent / kernel.FILENAME).read_text()
    enum = re.search(r"enum Positions \{([^}]*)\}", src).group(1)
    spelled = {name: int(v) for name, v in re.findall(r"POSITIONS_(\w+) = (\d+)", enum)}
    assert spelled == {m.name: m.value for m in problem.Positions}


@pytest.mark.parametrize("shape,k_heads,rotary_dim,computed", [
    ((2, 16, 4, 128), None, None, False),
    ((64, 1, 32, 128), 8, None, False),        # decode step, GQA
    ((4, 512, 32, 128), 32, None, False),      # prefill-like
    ((3, 61, 7, 92), 3, None, False),          # odd sizes
    ((2, 37, 5, 80), None, 48, True),          # partial rotary, computed angles
    ((1, 300, 1, 256), None, 64, True),
])
def test_plan_covers_the_problem_within_block_limits(monkeypatch, shape, k_heads, rotary_dim,
                                                     computed):
    """Grid x block covers every token, sequence, head and chunk; blocks stay within 256
    threads; computed angles fit their shared memory."""
    b, s, h, d = shape
    p = _plan(monkeypatch, shape, rotary_dim=rotary_dim, k_heads=k_heads, computed=computed)
    chunks, lanes, tokens = p.block
    assert chunks * lanes * tokens <= plan.THREADS_PER_BLOCK
    assert chunks == p.rot_chunks + p.tail_chunks
    rot = d if rotary_dim is None else rotary_dim
    # rotate-half from tables: a thread per chunk of each half; computed: of one half (partners
    # loaded alongside)
    assert p.rot_chunks * p.vector == (rot if computed and not p.step else rot // 2)
    assert p.tail_chunks * p.vector == d - rot
    assert p.fold == 0 and p.grid[0] * tokens >= s and p.grid[1] == b  # bshd: no fold
    htot = h + (k_heads or 0)
    assert p.grid[2] * p.heads_per_split >= htot
    assert (p.grid[2] - 1) * p.heads_per_split < htot     # no empty head split
    if computed:
        assert 0 < p.shared_mem <= plan.SMEM_LIMIT
        assert p.shared_mem >= 2 * rot * 4 * tokens  # cos and sin rows [R] fp32 per token
    else:
        assert p.shared_mem == 0
    hints = _flags(p) & kernel.PLAIN_ACCESSES  # from the size (its own test)
    assert p.kernel == kernel.kernel_name(torch.bfloat16, torch.float32, p.vector, False,
                                           computed, p.index_bits, p.unroll,
                                           (0 if computed else kernel.PAIR_PER_THREAD) | hints)


def test_plan_walks_sbhd_tokens_in_memory_order(monkeypatch):
    """sbhd strides (the sequence stride outside the batch stride), computed angles or tables: one
    grid row over the s * b tokens, b fastest (the kernel recovers b = t % B, s = t / B); bshd
    keeps grid (s, b)."""
    b, s, h, d = 4, 300, 8, 128
    sbhd = (h * d, b * h * d, d)  # (batch, sequence, head) strides of a dense [s, b, h, d]
    p = _plan(monkeypatch, (b, s, h, d), src_strides=sbhd, computed=True)
    assert p.fold == b and p.grid[1] == 1 and p.grid[0] * p.block[2] >= s * b
    assert (p.grid[0] - 1) * p.block[2] < s * b
    unfolded = _plan(monkeypatch, (b, s, h, d), src_strides=sbhd, computed=True,
                     memory_order=False)
    assert unfolded.fold == 0 and unfolded.grid[1] == b
    assert _plan(monkeypatch, (1, s, h, d), src_strides=sbhd, computed=True).fold == 0
    # given tables walk in memory order too; bshd keeps one sequence per grid row
    for dtype in (torch.bfloat16, torch.float32):
        assert _plan(monkeypatch, (b, s, h, d), src_strides=sbhd, dtype=dtype,
                     tables_dtype=dtype).fold == b
        assert _plan(monkeypatch, (b, s, h, d), src_strides=sbhd, dtype=dtype,
                     tables_dtype=dtype, memory_order=False).fold == 0
        assert _plan(monkeypatch, (b, s, h, d), dtype=dtype, tables_dtype=dtype).fold == 0


def test_plan_heads_per_step_from_the_work(monkeypatch):
    """4 heads per step from 8x the resident threads (132 SMs faked); between 2x and 8x, one
    head for a thread per chunk of one half from given tables (the one_half_per_thread ablation:
    rope.cu caps their registers), 2 otherwise."""
    big, medium, small = (4, 4096, 32, 128), (1, 4096, 32, 128), (1, 512, 32, 128)
    assert _plan(monkeypatch, big, dtype=torch.float32).unroll == 4
    assert _plan(monkeypatch, big, computed=True).unroll == 4
    assert _plan(monkeypatch, medium).unroll == 2  # both halves per thread
    assert _plan(monkeypatch, medium, one_half_per_thread=True).unroll == 1
    assert _plan(monkeypatch, medium, computed=True).unroll == 2
    assert _plan(monkeypatch, medium, in_place=True).unroll == 2
    assert _plan(monkeypatch, small).unroll == 1
    assert _plan(monkeypatch, small, computed=True).unroll == 1


def test_plan_16_bit_past_the_l2_takes_8_byte_accesses_and_2_heads_per_step(monkeypatch):
    """16-bit rotate-half from tables whose data outlives the L2 (out of place or in place):
    V = 4 (8 bytes) and 2 heads per step, in 256-thread blocks of one token; 4 heads per step
    where 2 would leave more head slots idle (40 heads). fp32, computed angles, interleaved,
    data that fits the L2 and the wide_steps_past_l2 ablation keep 16-byte accesses."""
    big = (4, 4096, 32, 128)  # 67 MB of bf16: past the L2 in place too
    for dtype in (torch.bfloat16, torch.float16):
        for in_place in (False, True):
            p = _plan(monkeypatch, big, dtype=dtype, in_place=in_place)
            assert (p.vector, p.unroll, p.block) == (4, 2, (16, 16, 1)), (dtype, in_place)
            assert p.kernel == kernel.kernel_name(dtype, torch.float32, 4, False, False, 32, 2,
                                                  kernel.PAIR_PER_THREAD)
    # GQA: 40 heads in one pass of 10 lanes x 4 heads (2 heads: 16 lanes, then a pass of 4);
    # 72 heads: 2 heads (3 passes of 16 lanes leave 24 slots idle, 2 passes of 4 heads 56)
    for in_place in (False, True):
        p = _plan(monkeypatch, big, k_heads=8, in_place=in_place)
        assert (p.vector, p.unroll, p.block) == (4, 4, (16, 10, 1)), in_place
    p = _plan(monkeypatch, (1, 4096, 64, 128), k_heads=8)
    assert (p.vector, p.unroll, p.block) == (4, 2, (16, 16, 1))
    p = _plan(monkeypatch, big, rotary_dim=64)  # the tail chunks narrow with the rotary ones
    assert (p.vector, p.rot_chunks, p.tail_chunks) == (4, 8, 16)
    assert (_plan(monkeypatch, big, dtype=torch.float32).vector,
            _plan(monkeypatch, big, computed=True).vector,
            _plan(monkeypatch, big, interleaved=True).vector) == (4, 8, 8)
    assert _plan(monkeypatch, big, interleaved=True).unroll == 4
    # the same problem inside the L2 (a 1 GiB L2 faked: an L2-sized 16-bit prefill takes the
    # step kernel by its work) keeps 16 bytes and 4 heads
    p = _plan(monkeypatch, big, l2=1 << 30)
    assert (p.vector, p.unroll, p.step) == (8, 4, False)
    wide = _plan(monkeypatch, big, vector_cap=8, unroll=4)  # the wide_steps_past_l2 ablation
    assert (wide.vector, wide.unroll) == (8, 4)


def test_idle_head_slots_count_the_passes_lanes():
    """Head slots left idle by a block's passes: lanes (up to 256 threads of 16 chunks: 16) x
    heads per step per pass."""
    assert [plan.idle_head_slots(h, u, 16) for h, u in
            ((32, 2), (32, 4), (40, 2), (40, 4), (72, 2), (72, 4), (8, 2), (3, 4))] == \
        [0, 0, 24, 0, 24, 56, 0, 1]


def test_plan_fp32_in_place_past_the_l2_takes_2_heads_per_step(monkeypatch):
    """fp32 rotate-half in place from tables whose data outlives the L2: 16-byte accesses and 2
    heads per step where every thread still takes one step (up to 32 heads: 16 lanes). More
    heads, out of place, computed angles, interleaved, data that fits the L2 and the
    wide_steps_past_l2 ablation keep 4 heads."""
    big = (2, 4096, 32, 128)  # 67 MB of fp32
    p = _plan(monkeypatch, big, dtype=torch.float32, in_place=True)
    assert (p.vector, p.unroll, p.block) == (4, 2, (16, 16, 1))
    p = _plan(monkeypatch, (1, 32768, 8, 128), dtype=torch.float32, in_place=True)
    assert (p.vector, p.unroll, p.block) == (4, 2, (16, 4, 4))
    for heads, k_heads in ((64, None), (32, 8)):
        p = _plan(monkeypatch, (1, 4096, heads, 128), k_heads=k_heads, dtype=torch.float32,
                  in_place=True)
        assert p.unroll == 4, (heads, k_heads)
    for kw in (dict(in_place=False), dict(in_place=True, computed=True),
               dict(in_place=True, interleaved=True), dict(in_place=True, l2=1 << 30),
               dict(in_place=True, vector_cap=8, unroll=4)):
        assert _plan(monkeypatch, big, dtype=torch.float32, **kw).unroll == 4, kw


def test_launcher_packs_the_kernels_parameter_layouts():
    """The struct layouts launcher.py packs have the sizes rope.cu asserts for Params and
    StepParams (the sm_90 compile test checks the asserts themselves)."""
    src = (pathlib.Path(kernel.__file__).parent / kernel.FILENAME).read_text()
    sizes = dict(re.findall(r"static_assert\(sizeof\((\w+)\) == (\d+)", src))
    assert int(sizes["Params"]) == launcher._DYNAMIC.size + launcher._STATIC.size
    assert int(sizes["StepParams"]) == launcher._DYNAMIC.size + launcher._STEP_STATIC.size


def test_plan_small_problems_take_the_step_kernel(monkeypatch):
    """Given tables, fewer chunk-rows than the bound (the next test), 32-bit offsets and the
    caller's conditions met (step_eligible): the step kernel, one thread per (token, chunk) and
    one head (step_heads: more), grid (S, B, head blocks), the heads of a token spread evenly
    over the fewest blocks of <= 256 threads, or over more (down to a warp each) while the blocks
    are fewer than the SMs. Anything else takes the main kernel."""
    decode = dict(shape=(64, 1, 32, 128), k_heads=8)
    p = _plan(monkeypatch, **decode, step_eligible=True)
    # rotate-half: a thread owns a chunk of each half (8 chunk threads per row of 128 bf16)
    # (a decode step's data fits in the L2: plain accesses)
    assert p.step and p.kernel == kernel.step_kernel_name(
        torch.bfloat16, torch.float32, 8, False, kernel.PAIR_PER_THREAD | kernel.PLAIN_ACCESSES)
    # 40 heads x 8 chunks: 2 blocks would hold them; 64 tokens x 3 blocks of 14 heads cover
    # the 132 SMs
    assert p.grid == (1, 64, 3) and p.block == (8, 14, 1) and p.index_bits == 32
    # b = 1: 10 blocks of a warp (4 heads) each, on 10 SMs
    one = _plan(monkeypatch, (1, 1, 32, 128), k_heads=8, step_eligible=True)
    assert one.step and one.grid == (1, 1, 10) and one.block == (8, 4, 1)
    # 256 x 72 heads: 3 blocks of 24 heads per token, one head per thread; 2 heads per thread
    # (the step_heads ablation): 2 blocks of 18 lanes
    wide = _plan(monkeypatch, (256, 1, 64, 128), k_heads=8, step_eligible=True)
    assert wide.step and wide.grid == (1, 256, 3) and wide.block == (8, 24, 1)
    two = _plan(monkeypatch, (256, 1, 64, 128), k_heads=8, step_eligible=True, step_heads=2)
    assert two.grid == (1, 256, 2) and two.block == (8, 18, 1)
    assert two.kernel.endswith(", 2, -1>") and p.kernel.endswith(", 1, -1>")
    inter = _plan(monkeypatch, **decode, interleaved=True, in_place=True, step_eligible=True)
    assert inter.step and inter.kernel.endswith(", 8, true, 2, 1, -1>") and inter.block[0] == 16
    # the problem's switches compiled in, unless the runtime_switches ablation reads them
    sw = kernel.step_switches(1, False, True, True)  # offsets, int64, [L, R/2] tables, backward
    assert _plan(monkeypatch, **decode, step_eligible=True,
                 step_switches=sw).kernel.endswith(f", 1, {sw}>")
    assert _plan(monkeypatch, **decode, step_eligible=True, step_switches=sw,
                 runtime_switches=True).kernel.endswith(", 1, -1>")
    partial = _plan(monkeypatch, **decode, rotary_dim=64, step_eligible=True)
    assert partial.rot_chunks == 4 and partial.tail_chunks == 8 and partial.block[0] == 12
    for kw in (dict(computed=True), dict(step_kernel=False), dict(unroll=1),
               dict(shape_rule="fixed"), dict(index_bits=64), dict(flags=kernel.FLAT_INDEX)):
        other = _plan(monkeypatch, **decode, **{"step_eligible": True, **kw})
        assert not other.step and other.kernel.startswith("rope_rows<"), kw
    assert not _plan(monkeypatch, **decode).step  # the caller's conditions unmet



def test_plan_step_kernel_bound_by_dtype_and_walk(monkeypatch):
    """The step kernel up to 8x the resident threads' chunk-rows (132 SMs faked) for 16-bit data
    and 4x for fp32 (plan.step_work_bound); 2x for sbhd with B > 1, whose tokens the main kernel
    walks in memory order. Past the bound, the main kernel's unrolled steps."""
    resident = 132 * 2048

    def step(shape, dtype=torch.bfloat16, **kw):
        return _plan(monkeypatch, shape, dtype=dtype, tables_dtype=dtype, step_eligible=True,
                     **kw).step

    # bf16/fp16: 8 chunk threads per row of 128, 32 heads: 8x is 8448 tokens
    assert 8448 * 32 * 8 == 8 * resident
    for dtype in (torch.bfloat16, torch.float16):
        assert step((1, 4096, 32, 128), dtype) and step((1, 8447, 32, 128), dtype)
        assert not step((1, 8448, 32, 128), dtype)
    # fp32: 16 chunk threads per row, 4x is 2112 tokens
    assert 2112 * 32 * 16 == 4 * resident
    assert step((1, 2111, 32, 128), torch.float32)
    assert not step((1, 2112, 32, 128), torch.float32)
    # sbhd, B = 2: 2x is 1056 tokens of each sequence; B = 1 is bshd's walk
    b, h, d = 2, 32, 128
    assert step((b, 1055, h, d), src_strides=(h * d, b * h * d, d))
    assert not step((b, 1056, h, d), src_strides=(h * d, b * h * d, d))
    assert step((b, 1056, h, d))
    assert step((1, 4096, h, d), src_strides=(4096 * h * d, h * d, d))
    big = _plan(monkeypatch, (1, 8448, 32, 128), step_eligible=True)
    assert not big.step and (big.unroll, big.vector) == (2, 4)  # past the L2 (its own test)


def test_plan_step_kernel_heads_per_thread(monkeypatch):
    """One head per thread in the step kernel, except in place on 16-bit data from 2x the resident
    threads' chunk-rows (132 SMs faked): 4 heads where a block of them fills whole warps, at least
    two (32 heads: 8 lanes of 8 chunks), else 2 (40 heads: 10 lanes of 4 would leave a warp
    part-filled), else 1 (8 heads: 2 heads would make blocks of one warp). The step_heads
    ablation overrides."""
    resident = 132 * 2048

    def heads(shape, dtype=torch.bfloat16, in_place=True, **kw):
        p = _plan(monkeypatch, shape, dtype=dtype, tables_dtype=dtype, step_eligible=True,
                  in_place=in_place, **kw)
        assert p.step and p.kernel.endswith(f", {p.unroll}, -1>")  # rope_step<..., HEADS, SW>
        return p.unroll

    assert 2112 * 32 * 8 == 2 * resident
    assert heads((1, 2112, 32, 128)) == 4 and heads((1, 2111, 32, 128)) == 1
    assert heads((1, 4096, 32, 128), torch.float16) == 4
    assert heads((1, 4096, 32, 128), k_heads=8) == 2
    assert heads((1, 32768, 8, 128)) == 1
    assert heads((1, 4096, 32, 128), in_place=False) == 1
    assert heads((1, 2000, 32, 128), torch.float32) == 1  # 3.8x, under fp32's 4x bound
    assert heads((1, 1, 32, 128), k_heads=8) == 1  # decode
    assert heads((1, 4096, 32, 128), step_heads=1) == 1


def test_plan_bf16_gets_16_byte_vectors_and_32_bit_offsets(monkeypatch):
    p = _plan(monkeypatch)
    assert p.vector == 8 and p.index_bits == 32
    assert "int, " in p.kernel and "long long" not in p.kernel


def test_plan_in_place_skips_the_tail(monkeypatch):
    assert _plan(monkeypatch, rotary_dim=64).tail_chunks == 64 // 8
    assert _plan(monkeypatch, rotary_dim=64, in_place=True).tail_chunks == 0


def test_plan_uses_64_bit_offsets_past_int32(monkeypatch):
    """Strides whose largest offset passes 2^31 - 1 select the 64-bit instantiation (the plan
    reads strides only; nothing is allocated at that size)."""
    p = _plan(monkeypatch, src_strides=(2**31, 512, 128))
    assert p.index_bits == 64 and "long long" in p.kernel
    assert _plan(monkeypatch, index_bits=64).index_bits == 64  # the int64_index ablation


def test_plan_refuses_interleaved_with_odd_strides(monkeypatch):
    with pytest.raises(ValueError, match="interleaved RoPE needs each pair in one aligned access"):
        _plan(monkeypatch, interleaved=True, src_strides=(8193, 513, 129))
    p = _plan(monkeypatch, interleaved=False, src_strides=(8193, 513, 129))
    assert p.vector == 1  # rotate-half falls back to scalar accesses


def test_plan_vector_cap(monkeypatch):
    assert _plan(monkeypatch, vector_cap=1).vector == 1
    assert _plan(monkeypatch, vector_cap=1, interleaved=True).vector == 2  # pairs stay whole


def test_plan_refuses_rows_wider_than_a_block(monkeypatch):
    """A row that needs more chunk threads than a block holds is refused on the host."""
    with pytest.raises(ValueError, match="threads per row"):
        _plan(monkeypatch, shape=(1, 4, 1, 1024), src_strides=(4097, 1025, 1025))


# ---- the registry ------------------------------------------------------------------------------
def test_fastrope_specs_are_registered():
    assert {s.name for s in registry.select(["fastrope"])} == FASTROPE_NAMES
    for name in FASTROPE_NAMES:
        spec = registry.get(name)
        assert spec.family == "fastrope" and spec.kind != "ablation" and spec.backend == "cupy"


def test_ablations_run_only_when_named():
    default = registry.select()
    assert FASTROPE_NAMES <= {s.name for s in default}
    assert not [s.name for s in default if s.kind == "ablation" or s.family == "fastrope-ablation"]
    ablations = registry.select(["fastrope-ablation"])
    assert len(ablations) >= 5
    assert all(s.kind == "ablation" and s.name.startswith("fastrope-ablation.") for s in ablations)
    one = registry.select(["fastrope-ablation.scalar_access"])
    assert [s.name for s in one] == ["fastrope-ablation.scalar_access"]
    assert not {s.name for s in registry.select(["fastrope"])} & {s.name for s in ablations}


@pytest.mark.parametrize("spec", registry.select(["fastrope", "fastrope-ablation"]),
                         ids=lambda s: s.name)
def test_fastrope_specs_describe_their_design(spec):
    for field in ("summary", "launch", "access", "math", "per_thread", "upstream"):
        value = getattr(spec, field)
        assert isinstance(value, str) and value.strip(), f"{spec.name}.{field} is empty"


def test_fastrope_spec_support():
    """fastrope takes every smoke/crossval case on a GPU (computed angles: not the
    asymmetric ones), says why not on a CPU, and refuses fp64 tables."""
    cases = get_suite("smoke") + get_suite("crossval")
    for spec in registry.select(["fastrope"]):
        for case in cases:
            reason = spec.unsupported_reason(case, {"cuda"})
            if spec.name == "fastrope.rope_computed" and case.asymmetric:
                assert reason, case.describe()
            else:
                assert reason is None, (spec.name, case.describe(), reason)
            assert "NVIDIA GPU" in spec.unsupported_reason(case, {"cpu"})
    fp64_tables = RopeCase(2, 8, 2, 16, cos_sin_dtype="fp64")
    assert "fp64" in registry.get("fastrope.rope").unsupported_reason(fp64_tables, {"cuda"})
    assert registry.get("fastrope.rope_computed").unsupported_reason(fp64_tables, {"cuda"}) is None
    assert registry.get("fastrope.rope_computed").table_source == "computed"


# ---- the suites ------------------------------------------------------------------------------
def test_ablation_suite_has_cases_every_fastrope_spec_runs():
    cases = get_suite("ablation")
    assert cases and all(isinstance(c, RopeCase) for c in cases)
    for spec in registry.select(["fastrope", "fastrope-ablation"]):
        for case in cases:
            assert spec.unsupported_reason(case, {"cuda"}) is None, (spec.name, case.describe())


@pytest.mark.parametrize("name", ["smoke", "crossval", "decode", "partial", "positions", "varlen",
                                  "gqa", "interleaved", "qkv", "long", "ablation"])
def test_fastrope_suites_exist(name):
    cases = get_suite(name)
    assert cases and all(isinstance(c, RopeCase) for c in cases)


# ---- the experiment interface -------------------------------------------------------------------
def test_experiment_variants_are_build_options():
    """Each variant is rope.cu's ROPE_* macros; the design is built with none, and every macro
    the options name is one rope.cu reads."""
    from ports.fastrope import experiment

    assert experiment.DESIGN.options == kernel.OPTIONS
    v = experiment.Variant(plain_loads=True, plain_stores=True, traffic_only=True, min_blocks=2)
    src = (pathlib.Path(kernel.__file__).parent / kernel.FILENAME).read_text()
    for opt in v.options:
        macro = opt[2:].split("=")[0]
        assert f"#ifdef {macro}" in src, macro
    with pytest.raises(ValueError, match="min_blocks"):
        experiment.Variant(min_blocks=0)


def test_experiment_variant_source_is_a_rope_cu():
    """A variant's source is another rope.cu's text: one without the two kernels is refused
    before anything compiles, and the text stays out of the variant's repr."""
    from ports.fastrope import experiment

    for bad in ("", 'extern "C" __global__ void k() {}', b"rope_rows( rope_step("):
        with pytest.raises(ValueError, match="rope_rows and rope_step"):
            experiment.Variant(source=bad)
    v = experiment.Variant(source=kernel.MODULE.source)
    assert v != experiment.DESIGN and "source" not in repr(v)


def test_experiment_plans_fix_the_shape(recorded_launches):
    """experiment.plans gives the plans of a call; unroll and head splits fix the main kernel's
    shape, the rest from the plan's arithmetic."""
    from ports.fastrope import experiment

    q = fake(rand(2, 64, 8, 64))
    tables = dict(cos=rand(64, 64), sin=rand(64, 64))
    (design,) = experiment.plans(q, **tables)
    assert design.step
    (fixed,) = experiment.plans(q, unroll=2, head_splits=4, **tables)
    assert not fixed.step and fixed.unroll == 2 and fixed.grid[2] == 4
    assert fixed.heads_per_split == 2 and fixed.block[1] == 2  # lanes: at most the split's heads


def test_design_names_every_rule_and_its_measurement():
    """DESIGN.md's rule table names every row of plan.RULES, and each row's section is a
    heading there."""
    text = (pathlib.Path(plan.__file__).parent / "DESIGN.md").read_text()
    headings = set(re.findall(r"^#+ (.+)$", text, flags=re.M))
    for rule in plan.RULES:
        assert f"| {rule.name} |" in text, rule.name
        assert rule.section in headings, rule.section


@pytest.mark.parametrize("variant", [
    dict(traffic_only=True), dict(plain_loads=True, plain_stores=True), dict(min_blocks=2),
    dict(source=kernel.MODULE.source.replace("rope_step(", "rope_step(  "))],
    ids=["traffic_only", "plain", "min_blocks", "source"])
def test_experiment_variants_compile_for_sm90(variant):
    """Each build option, and another source (here rope.cu respaced), compiles rope.cu's
    instantiations (both kernels, both styles, both angle sources) for sm_90 (NVRTC through
    CuPy; skipped where it cannot be loaded)."""
    from ports import _cupy
    from ports.fastrope import experiment

    try:
        _cupy.compile_source('extern "C" __global__ void k() {}', filename="probe.cu",
                             options=(), name_expressions=[], arch="sm_90", method="ptx")
    except Exception as e:  # noqa: BLE001 (any failure to load NVRTC)
        pytest.skip(f"NVRTC cannot compile here: {e}")
    names = [n for n in kernel.COMPILE_CHECKED if "__nv_bfloat16" in n][:6]
    names += [n for n in kernel.COMPILE_CHECKED if n.startswith("rope_step<")][:2]
    built = experiment.Variant(**variant)
    ptx, lowered = _cupy.compile_source(
        built.source or kernel.MODULE.source, filename=kernel.FILENAME, options=built.options,
        name_expressions=names, arch="sm_90", method="ptx")
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert all(f".entry {lowered[n]}" in text for n in names)


def test_rotate_spells_out_apply_ropes_keywords_in_order():
    """run.rotate's keywords after out are ARGUMENT_DEFAULTS, in its order and with its
    defaults (rotate_planned passes them on by position)."""
    params = list(inspect.signature(run.rotate).parameters.values())
    names = [p.name for p in params]
    tail = params[names.index("out") + 1:]
    assert [(p.name, p.default) for p in tail] == list(run.ARGUMENT_DEFAULTS.items())


def test_given_outputs_must_be_as_rope_allocates_them():
    """rope_out's outputs (run.rotate's ``out``) must be laid out as new_outputs makes them, which
    the cached launches were planned for, and apart from the inputs and each other; anything
    else is refused before a launch."""
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    good = run.new_outputs([q, k])
    assert run._outputs_like([q, k], tuple(good)) == good
    wrong = {
        "a list of 2": [good[0]],
        "contiguous": [torch.empty(2, 5, 16, 4).transpose(2, 3), good[1]],
        "shape, dtype and device": [good[0].double(), good[1]],
    }
    for message, out in wrong.items():
        with pytest.raises(ValueError, match=message):
            run._outputs_like([q, k], out)
    spans = tuple(t.numel() * 4 for t in (q, k, *good))
    run._check_apart(spans, [q, k, *good])
    buf = torch.empty(q.numel() + k.numel())
    q_out = buf[:q.numel()].view(q.shape)
    k_out = buf[q.numel() - 4:q.numel() - 4 + k.numel()].view(k.shape)  # 16 bytes into q_out
    for out in ([q, good[1]], [good[0], k], [q_out, k_out]):
        with pytest.raises(ValueError, match="overlaps"):
            run._check_apart(spans, [q, k, *out])
