"""What a new user meets on a fresh machine: the install declares what the features use, a
missing optional package costs one line before any work, and every compare.py example in the
README finishes quickly on a CPU (or is refused at once with what to run instead)."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from conftest import HAS_GPU
from ports.harness import cases, cli, preflight

ROOT = Path(__file__).resolve().parents[1]


def test_the_install_declares_what_plots_need():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[]", d)[0] for d in project["dependencies"]}
    assert {"torch", "triton", "tabulate", "tqdm", "matplotlib", "pytest"} <= names
    # No upper bound: torch, triton and cupy-cuda13x ship wheels for every Python from 3.10 on.
    assert "<" not in project["requires-python"]


def test_plot_without_matplotlib_is_one_line_before_any_work(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    ran = []
    monkeypatch.setattr(cases, "cases_from_args", lambda args: ran.append(args) or [])
    with pytest.raises(SystemExit) as exc:
        cli.main(["--no-progress", "--suite", "smoke", "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and not ran  # refused before the cases were even built
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "--plot needs matplotlib" in lines[0] and "pip install" in lines[0]
    assert not (tmp_path / "p.png").exists()


def test_missing_package_names_the_install_command():
    assert preflight.missing_package("json", "json", "x") is None
    line = preflight.missing_package("no_such_module_here", "nosuch", "--feature")
    assert line.startswith("--feature needs nosuch") and "pip install nosuch" in line


@pytest.mark.skipif(HAS_GPU, reason="the CPU cap applies only where there is no GPU")
def test_cpu_refuses_gpu_sized_shapes_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--no-progress", "--shape", "4x4096x32x128", "--dtype", "bf16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert "4x4096x32x128" in err[0] and "--suite smoke" in err[0]
    assert f"--shape {preflight.SMALL_SHAPE}" in err[0]


@pytest.mark.skipif(HAS_GPU, reason="the CPU cap applies only where there is no GPU")
def test_cpu_keeps_the_small_cases_of_a_suite_and_names_the_rest(capsys, monkeypatch):
    from ports.harness.suites import get_suite

    small = get_suite("smoke")[:1]
    big = small[0].replace(batch=64, seqlen=64)
    monkeypatch.setattr(cases, "cases_from_args", lambda args: [*small, big])
    code = cli.main(["--no-progress", "--suite", "smoke", "--only", "torch.hf_rotate_half"])
    out, err = capsys.readouterr()
    assert code == 0 and out.count("## ") == 1
    assert "1 case(s) over the CPU cap" in err and big.describe() in err


def test_the_small_shape_the_refusal_suggests_is_under_the_cap():
    dims = cli.parse_shape(preflight.SMALL_SHAPE)
    assert not preflight.over_cpu_cap([cases.case_from_shape(dims, "bshd")])


def readme_examples() -> list[str]:
    """Every ``python compare.py ...`` line of the README's code blocks, comments stripped."""
    lines, in_code = [], False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        line = line.split(" #")[0].strip()
        if in_code and line.startswith("python compare.py"):
            lines.append(line)
    return lines


def test_the_readme_shows_compare_examples():
    assert len(readme_examples()) >= 5


EXAMPLE_SECONDS = 120  # a bound for a 2-core CI machine, well above a capped example's time


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory):
    """One folder for every example, run in README order (a later one may read an earlier one's
    JSON, as a reader following the README would)."""
    return tmp_path_factory.mktemp("readme_examples")


@pytest.mark.skipif(HAS_GPU, reason="on a GPU the README's examples are benchmarks, not tests")
@pytest.mark.parametrize("example", readme_examples())
def test_readme_example_finishes_quickly_on_a_cpu(example, example_dir):
    argv = shlex.split(example)[2:]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "compare.py"), "--no-progress", *argv],
                          cwd=example_dir, capture_output=True, text=True,
                          timeout=EXAMPLE_SECONDS)
    seconds = time.monotonic() - start
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    if proc.returncode != 0:  # refused at once: one line on stderr saying why (and what instead)
        said = proc.stderr.strip().splitlines()
        assert proc.returncode in (2, cli.EXIT_NEEDS_GPU) and len(said) == 1, proc.stderr
    assert seconds < EXAMPLE_SECONDS


def test_the_readme_is_a_guide_not_a_notebook():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    in_code = False
    for line in lines:
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and not line.startswith("|"):
            assert len(line) <= 120, line
