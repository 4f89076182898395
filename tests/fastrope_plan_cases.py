"""The problems whose launch plans tests/data/fastrope_plans.json.gz pins, and how to record them.

Each case is a dict of plain values (layout, sizes, dtypes, table form, positions, direction,
views); :func:`arguments` turns one into the tensors and keywords of ``run.rotate`` on a
GPU-less machine (CPU tensors that claim to be CUDA, ``torch.empty``: nothing is touched), and
:func:`fake_device` fakes the device side the planner reads (an H100: 132 SMs, 50 MiB of L2)
and records each launch instead of compiling or launching it. Both the test
(tests/test_fastrope_plans.py) and the script that wrote the expected plans from the code as it
was before the plan became a table (tests/data/fastrope_plans_from_ae91f86.py) use this module,
so it imports nothing of the package but the fakeable module names it is given.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import types

import torch

SM_COUNT = 132
L2_BYTES = 50 * 2**20
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
AXES = {"bshd": "bshd", "sbhd": "sbhd", "bhsd": "bhsd"}


class FakeCuda(torch.Tensor):
    """A CPU tensor that claims to be a CUDA tensor."""

    is_cuda = property(lambda self: True)


def _fake(t):
    return t.as_subclass(FakeCuda)


# (name, b, s, q heads, k heads (0: no k), head_dim)
SHAPES = [
    ("decode", 64, 1, 32, 8, 128),
    ("decode-b1", 1, 1, 32, 8, 128),
    ("tiny", 2, 16, 4, 2, 64),
    ("mid", 4, 512, 32, 8, 128),
    ("l2-prefill", 1, 4096, 32, 8, 128),
    ("big-prefill", 8, 4096, 32, 8, 128),
    ("40-heads", 1, 8192, 40, 0, 128),
    ("fp32-in-place", 2, 4096, 32, 0, 128),
    ("odd", 3, 423, 7, 3, 96),
]


def cases() -> list[dict]:
    """The pinned problems: every base shape x dtype x table form x in place x layout x style,
    then positions, partial rotary, the backward, views of a packed qkv and misaligned rows on
    a few of them, then the ablations on a subset."""
    out = []
    for (name, b, s, hq, hk, d), dt, tables, in_place, layout, inter in itertools.product(
            SHAPES, DTYPES, ("half", "full", "computed"), (False, True),
            ("bshd", "sbhd", "bhsd", "thd"), (False, True)):
        out.append(dict(shape=name, b=b, s=s, hq=hq, hk=hk, d=d, dtype=dt, tables=tables,
                        in_place=in_place, layout=layout, interleaved=inter))
    extras = []
    for base in out:
        if base["shape"] not in ("decode", "mid", "big-prefill", "odd") or base["layout"] == "bhsd":
            continue
        if base["dtype"] == "fp16" or base["tables"] == "full":
            continue
        for change in (dict(positions="int"), dict(positions="offsets"),
                       dict(positions="ids32"), dict(positions="ids64"),
                       dict(positions="ids1d"), dict(rot=base["d"] // 2), dict(inverse=True),
                       dict(view="qkv"), dict(view="misaligned"), dict(table_dtype="bf16"),
                       dict(hk=0)):
            if base["layout"] == "thd" and change.get("positions") in ("ids32", "ids64",
                                                                       "ids1d", "offsets"):
                continue
            if change.get("table_dtype") and base["tables"] == "computed":
                continue
            extras.append(dict(base, **change))
    out += extras
    out += [dict(shape="wide", b=1, s=8, hq=2, hk=0, d=1024, dtype="fp32", tables="full",
                 in_place=False, layout="bshd", interleaved=inter, view=view)
            for inter in (False, True) for view in ("contiguous", "misaligned")]
    out += [dict(shape="huge-d", b=1, s=8, hq=2, hk=0, d=4096, dtype=dt, tables="half",
                 in_place=ip, layout="bshd", interleaved=False) for dt in DTYPES
            for ip in (False, True)]
    return out


ABLATION_SHAPES = ("decode", "tiny", "mid", "l2-prefill", "big-prefill", "40-heads",
                   "fp32-in-place")


def ablation_cases() -> list[dict]:
    """The problems each registry ablation is pinned on."""
    return [c for c in cases()
            if c["shape"] in ABLATION_SHAPES and c["dtype"] != "fp16" and len(c) == 11
            and c["layout"] in ("bshd", "sbhd")]


def arguments(case: dict) -> tuple[list, dict]:
    """(xs, keywords of run.rotate less in_place) for one case."""
    b, s, hq, hk, d = (case[k] for k in ("b", "s", "hq", "hk", "d"))
    dtype = DTYPES[case["dtype"]]
    layout, view = case["layout"], case.get("view", "contiguous")
    rot = case.get("rot") or d

    def tensor(heads, index):
        if layout == "thd":
            shape = (b * s, heads, d)
        elif layout == "bshd":
            shape = (b, s, heads, d)
        elif layout == "sbhd":
            shape = (s, b, heads, d)
        else:
            shape = (b, heads, s, d)
        if view == "qkv":  # q or k cut from a packed [.., hq + 2 hk, d] tensor
            packed = list(shape)
            head_axis = 1 if layout in ("thd", "bhsd") else 2
            packed[head_axis] = hq + 2 * max(hk, 1)
            start = 0 if index == 0 else hq
            return torch.empty(packed, dtype=dtype).narrow(head_axis, start, heads)
        if view == "misaligned":  # rows start one element past an aligned address
            flat = torch.empty(int(torch.Size(shape).numel()) + 1, dtype=dtype)
            return flat[1:].view(shape)
        return torch.empty(shape, dtype=dtype)

    xs = [_fake(tensor(hq, 0))] + ([_fake(tensor(hk, 1))] if hk else [])
    kw = dict(style="interleaved" if case["interleaved"] else "rotate_half", layout=layout,
              rotary_dim=case.get("rot"), check_positions=False, inverse=case.get("inverse", False))
    rows = s + 64
    if case["tables"] != "computed":
        width = rot // 2 if case["tables"] == "half" else rot
        tdt = DTYPES[case.get("table_dtype", "fp32")]
        kw.update(cos=torch.empty(rows, width, dtype=tdt), sin=torch.empty(rows, width, dtype=tdt))
    if layout == "thd":
        kw.update(cu_seqlens=torch.arange(0, b * s + 1, s, dtype=torch.int32), max_seqlen=s)
    pos = case.get("positions", "arange")
    if pos == "int":
        kw.update(offsets=7)
    elif pos == "offsets":
        kw.update(offsets=torch.zeros(b, dtype=torch.int64))
    elif pos in ("ids32", "ids64"):
        shape = (s, b) if layout == "sbhd" else (b, s)
        ids = torch.zeros(shape, dtype=torch.int32 if pos == "ids32" else torch.int64)
        kw.update(positions=ids.t() if layout == "sbhd" else ids)
    elif pos == "ids1d":
        kw.update(positions=torch.zeros(s, dtype=torch.int64))
    return xs, kw


def fake_device(monkeypatch_setattr, *, plan, kernel, launcher) -> list:
    """Fake the device side (``monkeypatch_setattr(module, name, value)``) and return the list
    each launch is recorded into as a dict: its plan's fields, a digest of its packed
    per-problem parameters and the
    tensors it covers."""
    launches = []
    monkeypatch_setattr(plan, "sm_count", lambda index: SM_COUNT)
    monkeypatch_setattr(plan, "l2_bytes", lambda index: L2_BYTES)
    monkeypatch_setattr(plan, "device_rules", lambda index: plan.RULES)
    monkeypatch_setattr(kernel, "function_ptr", lambda device, name: 1)
    monkeypatch_setattr(launcher, "_driver", lambda: types.SimpleNamespace(
        launchKernel=None, ctxGetCurrent=None, ctxSetCurrent=None))
    monkeypatch_setattr(launcher, "primary_context", lambda device: 0)

    def record(lc, q_in, k_in, *pointers):
        fields = dataclasses.asdict(lc.plan)
        fields = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}
        digest = hashlib.sha1(lc.static).hexdigest()[:16]
        launches.append(dict(fields, static=digest, tensors=1 + bool(k_in)))

    monkeypatch_setattr(launcher, "launch", record)
    return launches


def outcome(call, xs, kw, launches: list) -> list | str:
    """The launches one call makes, or its error as ``"TypeName: message"``."""
    launches.clear()
    try:
        call(xs, kw)
    except (ValueError, NotImplementedError, TypeError, IndexError) as e:
        return f"{type(e).__name__}: {e}"
    return list(launches)


def family_geometry(family: str) -> tuple[int, int]:
    """(SM count, L2 bytes) of a tuning table's family name, as tuning.family_name writes it
    ("sm_90, 132 SMs, 50 MiB L2, 5120-bit memory bus")."""
    parts = [p.strip() for p in family.split(",")]
    sms = int(parts[1].split()[0])
    l2 = float(parts[2].split()[0])
    return sms, int(l2 * 2**20)


def tuned_digests(monkeypatch_setattr, table: dict, *, plan, kernel, launcher, run) -> list[str]:
    """For every problem of :func:`cases`, in order, a digest of the launches the design makes on
    a GPU of ``table``'s family (the planner faked to its SM count and L2 size, and the table's
    choices), or of its error."""
    launches = fake_device(monkeypatch_setattr, plan=plan, kernel=kernel, launcher=launcher)
    sms, l2 = family_geometry(table["family"])
    rules = plan.with_choices(table["choices"])
    monkeypatch_setattr(plan, "sm_count", lambda index: sms)
    monkeypatch_setattr(plan, "l2_bytes", lambda index: l2)
    monkeypatch_setattr(plan, "device_rules", lambda index: rules)

    def call(xs, kw):
        in_place = kw.pop("in_place")
        run.DESIGN.entries.clear()
        run.rotate(*xs, in_place=in_place, **kw)

    digests = []
    for case in cases():
        xs, kw = arguments(case)
        got = outcome(call, xs, dict(kw, in_place=case["in_place"]), launches)
        digests.append(hashlib.sha1(json.dumps(got, sort_keys=True).encode()).hexdigest()[:10])
    return digests
