"""compare.py: the printed tables, the registry listing, and argument errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ports import registry
from ports.harness import cli, report
from ports.harness.result import Result

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    code = cli.main(["--no-progress", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_prints_every_implementation(capsys):
    code, out, _ = run(capsys, "--list")
    assert code == 0
    for name in registry.NAMES:
        assert name in out


def test_list_json_has_required_keys(capsys):
    code, out, _ = run(capsys, "--list", "--json")
    rows = json.loads(out)
    # ablations (run only when named) are listed after the rest
    assert code == 0 and sorted(r["name"] for r in rows) == sorted(registry.NAMES)
    for key in ("name", "family", "backend", "styles", "layouts", "dtypes", "backward", "upstream"):
        assert all(key in r for r in rows)


def test_verbose_shape_run_prints_all_rows_with_reasons(capsys):
    code, out, _ = run(capsys, "--shape", "2x8x3x16", "--layout", "bshd", "--dtype", "fp32",
                       "bf16", "--style", "rotate_half", "interleaved", "--verbose")
    assert code == 0
    assert out.count("## ") == 4  # 2 dtypes x 2 styles
    for name in (s.name for s in registry.select()):  # ablations run only when named
        assert out.count(name) >= 4  # every implementation appears in every table
    # every unsupported cell carries a reason
    for line in out.splitlines():
        if "unsupported" in line:
            assert "unsupported: " in line
    if not __import__("torch").cuda.is_available():
        assert "Timing and the CuPy ports need an NVIDIA GPU" in out
        assert "no GPU" in out


def test_layout_order_of_shape(capsys):
    code, out, _ = run(capsys, "--shape", "8x2x3x16", "--layout", "sbhd", "--only",
                       "torch.hf_rotate_half")
    assert code == 0 and "sbhd 8x2x3x16" in out


def test_backward_only_runs_the_backward_cases():
    from ports.harness.cases import cases_from_args
    from ports.harness.cli import build_parser

    parse = build_parser().parse_args
    both = cases_from_args(parse(["--suite", "smoke", "--backward"]))
    only = cases_from_args(parse(["--suite", "smoke", "--backward-only"]))
    assert {c.direction for c in only} == {"backward"}
    assert sorted(map(repr, only)) == sorted(repr(c) for c in both if c.direction == "backward")
    shape = cases_from_args(parse(["--shape", "2x8x2x16", "--backward-only"]))
    assert [c.direction for c in shape] == ["backward"]


def test_backward_and_thd_and_json_output(capsys, tmp_path):
    path = tmp_path / "r.json"
    code, _, _ = run(capsys, "--shape", "3x9x2x16", "--layout", "thd", "--backward",
                       "--json", str(path), "--only", "eager")
    assert code == 0
    rows = json.loads(path.read_text())
    assert {r["case_direction"] for r in rows} == {"forward", "backward"}
    assert {"gpu", "torch", "git_sha", "timestamp", "status", "max_abs_err"} <= set(rows[0])
    hf = [r for r in rows if r["impl"] == "torch.hf_rotate_half"]
    assert all(r["status"] == "ok" for r in hf)


def test_csv_to_stdout(capsys):
    code, out, _ = run(capsys, "--shape", "1x4x1x8", "--csv", "--only", "torch.hf_rotate_half")
    assert code == 0
    header = out.splitlines()[0]
    assert "impl" in header and "max_abs_err" in header


def test_malformed_shape_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--shape", "4x4096x32"])
    assert exc.value.code == 2
    assert "malformed shape '4x4096x32'" in capsys.readouterr().err


def test_unknown_only_names_families_and_closest_matches(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--shape", "1x4x1x8", "--only", "apex.nope"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unknown implementation 'apex.nope'" in err
    assert "families: eager, leetcuda, apex" in err and "backends: torch, cupy, triton" in err
    assert "closest: apex.fused_rope" in err and "torch.hf_rotate_half" not in err
    assert len(err.splitlines()) == 1 and len(err) < 400


def test_invalid_case_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--shape", "1x4x1x8", "--rotary-dim", "12"])
    assert exc.value.code == 2 and "--rotary-dim 12 must be <= the head dim (8" in \
        capsys.readouterr().err


def test_nothing_to_run(capsys):
    with pytest.raises(SystemExit):
        cli.main([])
    assert "nothing to run" in capsys.readouterr().err


def test_failure_stops_unless_keep_going(capsys, monkeypatch):
    from ports.harness import runner

    real = runner.check_outputs

    def failing(case, spec, *a, **k):
        r = real(case, spec, *a, **k)
        if spec.name == "torch.hf_rotate_half":
            r.status, r.reason = "FAIL", "injected"
        return r

    monkeypatch.setattr(runner, "check_outputs", failing)
    code, out, err = run(capsys, "--shape", "1x4x1x8", "--dtype", "fp32", "fp64")
    assert code == 1 and out.count("## ") == 1 and "--keep-going" in err
    code, out, _ = run(capsys, "--shape", "1x4x1x8", "--dtype", "fp32", "fp64", "--keep-going")
    assert code == 1 and out.count("## ") == 2 and "FAIL: injected" in out


def test_raising_implementation_does_not_stop_the_rest(capsys, monkeypatch):
    import dataclasses

    def boom(case, inputs):
        raise RuntimeError("kaput")

    patched = tuple(dataclasses.replace(s, prepare=boom) if s.name == "torch.llama_real" else s
                    for s in registry.REGISTRY)
    monkeypatch.setattr(registry, "REGISTRY", patched)
    code, out, _ = run(capsys, "--shape", "1x4x1x8", "--style", "interleaved", "rotate_half",
                       "--keep-going")
    assert code == 1
    assert "error: RuntimeError: kaput" in out
    assert out.count("## ") == 2
    assert "| torch.torchtune" in out and "| ok " in out


def test_result_row_formats():
    ok = Result("a", "f", "port", "ok", max_abs_err=1.5e-3, max_rel_err=2e-4, err_over_tol=0.5,
                median_us=12.34, gbps=1000.4, pct_copy=33.3, speedup=2.0)
    assert report.result_row(ok) == ["a", "ok", "1.50e-03", "2.00e-04", "0.50", "12.3", "1000",
                                     "33.3", "2.00", "n/a"]  # no torch.compile time: n/a
    un = Result("b", "f", "port", "unsupported", "no backward")
    row = report.result_row(un)
    assert row[1] == "unsupported: no backward" and set(row[2:]) == {"unsupported"}
    fail = Result("c", "f", "port", "FAIL", "bad", max_abs_err=1.0, max_rel_err=1.0,
                  err_over_tol=9.0, timing_note="not timed: failed validation")
    assert report.result_row(fail)[5] == "failed"


def test_compare_py_runs_as_a_script():
    proc = subprocess.run([sys.executable, "compare.py", "--shape", "1x4x1x8", "--no-progress",
                           "--only", "torch.hf_rotate_half"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "torch.hf_rotate_half" in proc.stdout


def test_design_table_lists_every_implementation(capsys, tmp_path):
    rows = [{"impl": "torch.hf_rotate_half", "pct_copy": 10.0},
            {"impl": "torch.hf_rotate_half", "pct_copy": 12.0}]
    path = tmp_path / "prefill.json"
    path.write_text(json.dumps(rows))
    code, out, _ = run(capsys, "--design", str(path), "--verbose")  # a row per line
    assert code == 0
    for name in (s.name for s in registry.select()):
        assert name in out
    hf_line = next(line for line in out.splitlines() if "| torch.hf_rotate_half " in line)
    assert hf_line.rstrip(" |").endswith("11")  # median of 10 and 12
    assert "not measured" in out


def test_accuracy_on_cpu_says_what_it_needs(capsys, monkeypatch, tmp_path):
    from ports.harness import accuracy, preflight

    monkeypatch.setattr(accuracy, "MAX_POSITION", 2048)
    monkeypatch.setattr(preflight, "CPU_MAX_POSITION", 2048)
    code, out, _ = run(capsys, "--accuracy", "--only", "torch.hf_rotate_half", "torch.llama_real",
                       "--dtype", "fp32", "bf16", "--plot", str(tmp_path / "acc.png"))
    assert code == 0
    if not __import__("torch").cuda.is_available():
        assert "The CuPy and Triton ports need an NVIDIA GPU" in out
    assert "| torch.llama_real" in out and "computed (fp32 table)" in out
    assert (tmp_path / "acc.png").stat().st_size > 0


def test_claims_without_gpu_list_what_they_need(capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("on a GPU --claims runs the experiments (covered by the GPU suite script)")
    code, out, err = run(capsys, "--claims")
    assert code == cli.EXIT_NEEDS_GPU and "needs an NVIDIA GPU" in out
    assert err.count("\n") == 1 and "--claims times kernels and needs an NVIDIA GPU" in err
    for seed in ("000", "001", "002", "004"):
        assert f"| {seed} " in out


def test_claim_verdicts_compare_gains():
    from ports.harness.verdicts import ratio_verdict as _verdict

    assert _verdict(1.01, 1.15, 1.20) == "does not hold: smaller here"  # +1% vs +15-20%
    assert _verdict(1.24, 1.24) == "holds"
    assert _verdict(1.29, 1.36) == "holds"                               # +29% vs +36% +- 9%
    assert _verdict(0.89, 1.04) == "does not hold: smaller here"
    assert _verdict(79.7, 120, 170) == "does not hold: smaller here"
    assert _verdict(3.85, 1.52) == "does not hold: larger here"


def test_summary_pivots_a_results_file(capsys, tmp_path):
    rows = [{"impl": "a", "case": "c1", "status": "ok", "pct_copy": 50.4},
            {"impl": "b", "case": "c1", "status": "unsupported", "pct_copy": None},
            {"impl": "a", "case": "c2", "status": "FAIL", "pct_copy": None}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rows))
    code, out, _ = run(capsys, "--summary", str(path))
    assert code == 0
    lines = out.splitlines()
    assert "| a " in lines[0] and "| b " not in lines[0]  # b never ran: left out
    assert "| c1 " in out and "50" in lines[2] and "FAIL" in lines[3]
