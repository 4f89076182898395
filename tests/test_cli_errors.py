"""compare.py as a newcomer meets it: every bad file, value or name gives one line on stderr and
exit status 2; --help and argument errors come back at once (no torch import before parsing)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def compare(*argv, timeout=300):
    return subprocess.run([sys.executable, "compare.py", "--no-progress", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


def one_line_error(proc, *phrases):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("compare.py: error: "), proc.stderr
    for phrase in phrases:
        assert phrase in lines[0]
    assert "Traceback" not in proc.stderr and not proc.stdout


def test_help_is_fast_and_names_families_and_backends():
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "compare.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    took = time.perf_counter() - start
    assert proc.returncode == 0 and took < 1.5, took
    text = " ".join(proc.stdout.split())
    assert "family (eager, leetcuda, apex" in text and "backend (torch, cupy, triton)" in text
    assert "--verbose" in text and "smoke" in text


def test_parsing_imports_no_torch():
    code = ("import sys; from ports.harness import cli; cli.build_parser().parse_args("
            "['--suite', 'smoke']); print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.stdout.strip() == "False", proc.stderr


@pytest.mark.parametrize("argv, phrases", [
    (["--shape", "2x16x4x33"], ["head dim 33 must be even"]),
    (["--shape", "1x4x1x8", "--base", "-5"], ["'-5' is not a positive, finite RoPE base"]),
    (["--shape", "1x4x1x8", "--base", "0"], ["'0' is not a positive"]),
    (["--shape", "1x4x1x8", "--rotary-dim", "3"], ["--rotary-dim 3 must be even"]),
    (["--shape", "1x4x1x8", "--rotary-dim", "0"], ["'0' is not a positive integer"]),
    (["--shape", "1x4x1x8", "--kv-heads", "-1"], ["'-1' is not a positive integer"]),
    (["--shape", "2x16x4x32", "--seqlens", "3", "4"], ["--layout bshd has none"]),
    (["--shape", "2x16x4x32", "--layout", "thd", "--seqlens", "3"], ["b = 2 lengths"]),
    (["--shape", "2x16x4x32", "--layout", "thd", "--seqlens", "3", "17"], ["each <= s = 16"]),
    (["--shape", "4x4096x32"], ["malformed shape"]),
    (["--layout", "nope"], ["invalid choice: 'nope'"]),
    (["--suite", "seed004"], ["run compare.py --pipeline"]),
    (["--suite", "smok"], ["unknown suite 'smok'", "closest: smoke"]),
    (["--shape", "1x4x1x8", "--seed", "1" + "0" * 20], ["is not a seed: an integer from -2**63"]),
    (["--pipeline", "rope"], ["invalid choice: 'rope'"]),
    (["--pipeline", "--layout", "sbhd"], ["--layout does not apply to --pipeline"]),
    (["--list", "--claims"], ["--list and --claims are separate modes"]),
    (["--list", "--graph"], ["--graph does not apply to --list"]),
    (["--accuracy", "--layout", "sbhd"], ["--layout does not apply to --accuracy"]),
    (["--shape", "1x4x1x8", "--summary-value", "gbps"], ["--summary-value does not apply"]),
    (["--suite", "smoke", "--rotary-dim", "16"], ["--rotary-dim does not apply to --suite"]),
    ([], ["nothing to run"]),
])
def test_bad_values_are_one_line_errors(argv, phrases):
    one_line_error(compare(*argv), *phrases)


def test_argument_errors_are_fast():
    start = time.perf_counter()
    one_line_error(compare("--shape", "2x16x4x33"))
    assert time.perf_counter() - start < 1.5


@pytest.mark.parametrize("word", ["triton", "cupy", "torch"])
def test_backends_are_names_users_can_select(word):
    from ports.harness import cli

    args = cli.build_parser().parse_args(["--list", "--only", word])
    assert cli.mode_of(args) == "list"
    from ports import registry

    assert {s.backend for s in registry.select([word])} == {word}


def test_unknown_name_gives_families_and_closest():
    one_line_error(compare("--shape", "1x4x1x8", "--only", "apex.fused_rop"),
                   "families: eager", "backends: torch, cupy, triton", "closest: apex.fused_rope")


def results_file(tmp_path, rows, name="r.json"):
    path = tmp_path / name
    path.write_text(rows if isinstance(rows, str) else json.dumps(rows))
    return str(path)


def test_bad_results_files(tmp_path):
    one_line_error(compare("--summary", str(tmp_path / "missing.json")), "no such file",
                   "compare.py --json PATH")
    one_line_error(compare("--summary", results_file(tmp_path, "impl,case\na,b\n", "out.csv")),
                   "not JSON", "compare.py --json PATH")
    registry_rows = [{"name": "a", "family": "f", "upstream": "u"}]
    one_line_error(compare("--summary", results_file(tmp_path, registry_rows)),
                   "rows have no 'impl' field (a --list --json registry?)")
    one_line_error(compare("--design", str(tmp_path / "nope.json")), "no such file")
    one_line_error(compare("--summary", str(tmp_path)), "is a folder")


def test_summary_of_cpu_results_says_which_values_have_numbers(tmp_path):
    rows = [{"impl": "a", "case": "c1", "status": "ok", "gpu": "none (CPU)", "pct_copy": None,
             "err_over_tol": 0.1}]
    one_line_error(compare("--summary", results_file(tmp_path, rows)),
                   "no row has a pct_copy number", "without a GPU",
                   "values with numbers: err_over_tol")
    proc = compare("--summary", results_file(tmp_path, rows), "--summary-value", "err_over_tol")
    assert proc.returncode == 0 and "| a " in proc.stdout


def test_cli_choices_match_the_vocabulary():
    """The parser's torch-free choices are the vocabulary's, the suites' and the metrics'."""
    from ports.harness import cli, suites
    from reference import vocabulary

    assert cli.STYLES == vocabulary.STYLES and cli.LAYOUTS == vocabulary.LAYOUTS
    assert cli.DTYPES == tuple(vocabulary.DTYPES)
    assert cli.POSITION_KINDS == vocabulary.POSITION_KINDS
    assert cli.COS_SIN_DTYPES == vocabulary.COS_SIN_DTYPES
    assert cli.SUITES == tuple(suites.SUITES)
    assert not set(cli.MOVED_SUITES) & set(suites.SUITES)


def test_earlier_suite_names_are_accepted():
    from ports.harness import cli

    for old, new in cli.SUITE_ALIASES.items():
        assert cli.suite_name(old) == new
