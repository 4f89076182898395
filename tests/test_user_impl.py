"""A user's own function as a row: compare.py --impl module:function, the rope_impl declaration,
the rope_ports.impls entry points, and the README's example run through compare.py."""
from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ports import registry
from ports.harness import cli
from ports.peers import user
from reference.case import RopeCase

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_registry():
    """Restore the registry (and the modes' once-only flag) after a test adds user rows."""
    from ports.harness import modes

    saved = registry.REGISTRY, registry.NAMES
    yield
    registry.REGISTRY, registry.NAMES = saved
    modes._user_impls_added = False


def _compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "compare.py", *args, "--no-progress"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_the_readme_example_runs_through_compare_py(tmp_path):
    out = tmp_path / "r.json"
    proc = _compare("--suite", "smoke", "--shape", "2x16x4x32", "--dtype", "fp32", "bf16",
                    "--positions", "ids", "--backward", "--impl", "examples.my_rope:rope_half",
                    "--only", "user", "torch.hf_rotate_half", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = [r for r in json.loads(out.read_text()) if r["impl"] == "user.rope_half"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) >= 4 and all(r["err_over_tol"] <= 1 for r in ok)
    assert any(r["case_direction"] == "backward" for r in ok)  # autograd through it
    refused = {r["reason"] for r in rows if r["status"] == "unsupported"}
    assert "interleaved convention not implemented" in refused


def test_readme_shows_the_example_and_its_command():
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "examples" / "my_rope.py").read_text()
    body = example[example.index("@rope_impl"):].strip()
    assert body in readme
    assert "`ports.peers.user.rope_impl` imported" in " ".join(readme.split())
    assert "--impl examples.my_rope:rope_half" in " ".join(readme.split())


@pytest.mark.parametrize("target, words", [
    ("examples.my_rope", "expected module:function"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("examples.my_rope:no_such_fn", "has no attribute 'no_such_fn'"),
    ("examples.my_rope:torch", "not a callable"),
])
def test_a_bad_impl_is_one_line_and_exit_2(target, words):
    proc = _compare("--list", "--impl", target)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr


def test_impl_is_refused_by_modes_that_take_no_implementations():
    with pytest.raises(SystemExit) as exc:
        cli.main(["--overhead", "--impl", "examples.my_rope:rope_half"])
    assert exc.value.code == 2


def test_the_declaration_decides_what_runs(clean_registry):
    @user.rope_impl(styles=["interleaved"], layouts=["thd"], dtypes=["bf16"], kv_heads=False,
                    devices=["cpu"], name="mine")
    def fn(q, k, cos, sin, positions, *, style, layout, rotary_dim):
        return q

    spec = user.spec_from_callable(fn, "test:fn")
    assert spec.name == "user.mine" and spec.family == "user" and spec.kind == "peer"
    case = RopeCase(2, 8, 2, 16, layout="thd", seqlens=(8, 3), dtype="bf16",
                    style="interleaved")
    assert spec.unsupported_reason(case, {"cpu"}) is None
    assert "convention" in spec.unsupported_reason(case.replace(style="rotate_half"), {"cpu"})
    assert "kv_heads=False" in spec.unsupported_reason(case.replace(kv_heads=1), {"cpu"})
    assert "NVIDIA GPU" not in (spec.unsupported_reason(case, {"cpu"}) or "")
    with pytest.raises(user.BadImpl, match="layouts"):
        fn.rope_supports["layouts"] = ["xyz"]
        user.spec_from_callable(fn, "test:fn")
    with pytest.raises(TypeError, match="unknown keys"):
        user.rope_impl(style=["rotate_half"])


def test_a_wrong_user_function_fails_validation(clean_registry):
    @user.rope_impl(devices=["cpu"])
    def identity(q, k, cos, sin, positions, *, style, layout, rotary_dim):
        return q.clone(), None if k is None else k.clone()

    registry.add([user.spec_from_callable(identity, "test:identity")])
    from ports.harness.runner import run_case

    rep = run_case(RopeCase(2, 8, 2, 16), registry.select(["user"]), device=torch.device("cpu"),
                   targets=frozenset({"cpu"}), timing_on=False)
    assert rep.results[0].status == "FAIL"


def test_names_already_registered_are_refused(clean_registry):
    spec = user.load("examples.my_rope:rope_half")
    registry.add([spec])
    with pytest.raises(ValueError, match="already registered: user.rope_half"):
        registry.add([spec])


def test_entry_points_add_rows(clean_registry, monkeypatch):
    ep = importlib.metadata.EntryPoint(name="rope_half", value="examples.my_rope:rope_half",
                                       group=user.ENTRY_POINT_GROUP)
    broken = importlib.metadata.EntryPoint(name="broken", value="no_such_module_xyz:f",
                                           group=user.ENTRY_POINT_GROUP)

    def entry_points(group=None, **_):
        return [ep, broken] if group == user.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    with pytest.warns(UserWarning, match="entry point broken"):
        new = registry.add_user_impls()
    assert [s.name for s in new] == ["user.rope_half"]
    assert registry.get("user.rope_half").upstream.startswith("entry point rope_half")


def test_list_names_the_user_row_and_the_peers_that_cannot_run(clean_registry, capsys):
    assert cli.main(["--list", "--impl", "examples.my_rope:rope_half"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"user\.rope_half", out)
    from ports import registry

    missing = [s for s in registry.REGISTRY
               if s.kind == "peer" and getattr(s, "missing", None) and s.missing()]
    assert missing  # vllm and transformer_engine are never installed where the tests run
    for spec in missing:
        assert f"{spec.name}: not installed: pip install" in err


# ---- a backward that writes into its incoming gradient ------------------------------------------
class _RotatesDyInPlace(torch.autograd.Function):
    """Rotate-half RoPE whose backward rotates dy in place and returns it (as Liger's does)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return dy.copy_(dy * cos - _rotate_half(dy) * sin), None, None


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rows(x, cos, sin, positions):
    """cos/sin rows [b, s, 1, d] for bshd x."""
    return cos[positions][:, :, None].to(x.dtype), sin[positions][:, :, None].to(x.dtype)


@pytest.mark.parametrize("dy_handed", ["the case's own", "a copy"])
def test_a_backward_that_writes_its_incoming_gradient_is_caught(clean_registry, dy_handed):
    """Handed the case's own dy (the canonical form): a FAIL that says so, since the check and
    the other rows read it. Handed a copy (a prepare that makes one, as the harness does for
    Liger): the row passes and carries a note under the table, as a graph that hands dy to two
    nodes would get a wrong gradient."""
    from ports._adapters import AutogradCall
    from ports.harness import report
    from ports.harness.runner import GRADIENT_WRITTEN, run_case

    def forward(xs, inputs):
        return tuple(_RotatesDyInPlace.apply(x, *_rows(x, inputs.cos, inputs.sin,
                                                        inputs.positions)) for x in xs)

    if dy_handed == "a copy":
        @user.rope_impl(styles=["rotate_half"], backward=True, devices=["cpu"], prepare=True,
                        name="writes_dy")
        def fn(case, inputs):
            leaves = [x.detach().clone().requires_grad_(True) for x in inputs.xs]
            return AutogradCall(lambda ls: forward(ls, inputs), leaves,
                                [g.clone() for g in inputs.grads])
    else:
        @user.rope_impl(styles=["rotate_half"], backward=True, devices=["cpu"],
                        name="writes_dy")
        def fn(q, k, cos, sin, positions, *, style, layout, rotary_dim):
            rows = _rows(q, cos, sin, positions)
            return tuple(_RotatesDyInPlace.apply(x, *rows) for x in (q, k))

    registry.add([user.spec_from_callable(fn, "test:fn")])
    case = RopeCase(2, 8, 2, 16, kv_heads=1, direction="backward")
    rep = run_case(case, registry.select(["user"]), device=torch.device("cpu"),
                   targets=frozenset({"cpu"}), timing_on=False)
    r = rep.results[0]
    if dy_handed == "a copy":
        assert r.status == "ok" and r.gradient_note == GRADIENT_WRITTEN, r.reason
        assert any("incoming gradient" in line for line in report.row_note_lines(rep.results))
        assert "incoming gradient" in report.case_table(rep)
    else:
        assert r.status == "FAIL" and "incoming gradient dy" in r.reason
        assert not r.gradient_note
