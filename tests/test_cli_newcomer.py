"""What a new user meets on a CPU machine: every mistake is one line and exit status 2 before any
work (cheap checks before torch is imported), the messages name what would be right, and output
fits 140 columns unless ``--verbose``."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_GPU
from ports.harness import accuracy, cli, report

ROOT = Path(__file__).resolve().parents[1]
# Runs cli.main in a fresh interpreter and says, after it exits, whether torch was imported.
PROBE = ("import json, sys\nfrom ports.harness import cli\ntry:\n"
         "    code = cli.main(sys.argv[1:])\nexcept SystemExit as exc:\n    code = exc.code\n"
         "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))")


def fresh(*argv: str) -> tuple[int, str, bool]:
    """(exit status, stderr, whether torch was imported) of ``compare.py argv`` in a new Python."""
    proc = subprocess.run([sys.executable, "-c", PROBE, "--no-progress", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    return said["code"], proc.stderr, said["torch"]


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("compare.py: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv, flag", [
    (["--suite", "smoke", "--json", "{missing}/r.json"], "--json"),
    (["--suite", "smoke", "--csv", "{missing}/r.csv"], "--csv"),
    (["--suite", "smoke", "--plot", "{missing}/p.png"], "--plot"),
    (["--list", "--json", "{missing}/registry.json"], "--json"),
    (["--accuracy", "--plot", "{missing}/a.png"], "--plot"),
    (["--suite", "smoke", "--json", "{folder}"], "--json"),
], ids=["json", "csv", "plot", "list-json", "accuracy-plot", "json-is-a-folder"])
def test_unwritable_output_paths_are_refused_before_any_work(tmp_path, argv, flag):
    argv = [a.format(missing=tmp_path / "no" / "such", folder=tmp_path) for a in argv]
    code, err, torch_imported = fresh(*argv)
    line = one_line(err)
    assert code == 2 and not torch_imported  # refused before the work (and before torch)
    assert line.startswith(f"compare.py: error: {flag} ")
    assert ("does not exist; create it" in line) or ("is a folder; give a file path" in line)
    assert not list(tmp_path.rglob("*.*"))


@pytest.mark.parametrize("argv, words", [
    (["--suite", "smoke", "--plot", "bandwidth.xyz"], "matplotlib does not write .xyz files"),
    (["--summary", "/nonexistent.json"], "--summary /nonexistent.json: no such file"),
    (["--design", "/nonexistent.json"], "--design /nonexistent.json: no such file"),
    (["--list", "--impl", "nosuchmodule:fn"], "cannot import module 'nosuchmodule'"),
    (["--suite", "smoke", "--impl", "examples/my_rope.py:rope_half"],
     "not a file path: --impl examples.my_rope:rope_half"),
])
def test_cheap_checks_come_before_torch(argv, words):
    code, err, torch_imported = fresh(*argv)
    assert code == 2 and words in one_line(err)
    assert not torch_imported


def test_a_file_path_impl_is_told_the_dotted_form_by_the_loader_too():
    from ports.peers import user

    with pytest.raises(user.BadImpl, match=r"--impl examples\.my_rope:rope_half$"):
        user.load(r"examples\my_rope.py:rope_half")


def test_only_with_an_unknown_name_and_nothing_to_run_names_the_name(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--only", "nosuchimpl"])
    line = one_line(capsys.readouterr().err)
    assert exc.value.code == 2 and "unknown implementation 'nosuchimpl'" in line
    assert "compare.py --list" in line and "nothing to run" not in line
    with pytest.raises(SystemExit):  # a known name: the run lacks cases
        cli.main(["--only", "apex"])
    assert "nothing to run: give --shape or --suite" in one_line(capsys.readouterr().err)


def test_summary_of_an_empty_results_file_says_it_is_empty(capsys, tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("[]")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--summary", str(path)])
    line = one_line(capsys.readouterr().err)
    assert exc.value.code == 2 and "the file has no results" in line
    assert "without a GPU" not in line


def test_summary_of_a_value_that_is_not_a_number_is_one_line(capsys, tmp_path):
    path = tmp_path / "edited.json"
    path.write_text(json.dumps([{"impl": "a", "case": "c", "status": "ok", "pct_copy": "abc"}]))
    with pytest.raises(SystemExit) as exc:
        cli.main(["--summary", str(path)])
    line = one_line(capsys.readouterr().err)
    assert exc.value.code == 2 and "row 0's pct_copy is 'abc', not a number" in line


def _row(impl, dtype, errors):
    return accuracy.AccuracyRow(impl, dtype, "computed", errors)


def test_accuracy_summarises_unsupported_rows_unless_verbose():
    rows = [_row("torch.a", "fp32", [1e-7, 2e-7]),
            _row("torch.a", "bf16", ["unsupported: no bf16"]),
            *(_row(f"apex.k{i}", d, ["unsupported: needs an NVIDIA GPU (cupy)"])
              for i in range(3) for d in ("fp32", "bf16")),
            _row("torch.b", "fp32", ["error: RuntimeError: boom"])]
    short = accuracy.table(rows, 2048, verbose=False)
    table_part, _, summary = short.partition("\n\n")
    assert "unsupported" not in table_part and "error: RuntimeError" in table_part
    assert summary.splitlines()[0].startswith("unsupported: ")
    assert "torch.a bf16 (no bf16)" in summary and "apex.* (needs an NVIDIA GPU (cupy))" in summary
    assert "--verbose" in summary
    full = accuracy.table(rows, 2048, verbose=True)
    assert full.count("| unsupported: ") == 7 and "--verbose" not in full


def widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def test_help_fits_140_columns_even_on_a_wide_terminal():
    proc = subprocess.run([sys.executable, "compare.py", "--help"], cwd=ROOT, text=True,
                          capture_output=True, timeout=60, env={"COLUMNS": "400", "PATH": ""},
                          check=False)
    assert proc.returncode == 0 and widest(proc.stdout) <= report.WIDTH, proc.stdout


def test_summary_of_many_implementations_fits_in_column_groups():
    names = [f"family{i}.implementation_name_{i}" for i in range(12)]
    rows = [{"impl": n, "case": f"bshd 4x4096x32x128 bf16 case {c}", "status": "ok",
             "pct_copy": 50.0 + i} for i, n in enumerate(names) for c in range(3)]
    text = report.summary_table(rows)
    assert widest(text) <= report.WIDTH
    assert text.count("| case") > 1  # several tables, each led by the case column
    for name in names:  # every implementation, its family over its name
        family, rest = name.split(".")
        assert f"| {family}." in text and f"| {rest}" in text


@pytest.mark.skipif(HAS_GPU, reason="the CPU modes' output (on a GPU they time and print more)")
def test_every_cpu_mode_fits_140_columns_unless_verbose(capsys, tmp_path):
    results = tmp_path / "smoke.json"
    outputs = {}
    for argv in (["--list"], ["--design"], ["--suite", "smoke", "--json", str(results)],
                 ["--summary", str(results)], ["--summary", str(results), "--summary-value",
                                                "err_over_tol"],
                 ["--claims"], ["--pipeline", "rbe"],
                 ["--accuracy", "--dtype", "fp32", "--only", "eager", "apex", "triton"]):
        try:
            cli.main(["--no-progress", *argv])
        except SystemExit:
            pass
        out, err = capsys.readouterr()
        outputs[" ".join(argv[:1])] = (widest(out), widest(err))
    too_wide = {mode: w for mode, w in outputs.items() if max(w) > report.WIDTH}
    assert not too_wide, too_wide
