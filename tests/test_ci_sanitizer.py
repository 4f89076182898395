"""The compute-sanitizer stages of .ci/gpu-suite, run on the CPU with stand-ins for
compute-sanitizer, nvidia-smi and python3 on PATH: one tool per stage, the files and the -k
filter each tool gets, bad names refused in one line (exit 2), and an overrun cut and reported."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "gpu-suite"
# compute-sanitizer's stand-in: prints its arguments and a clean summary (after STUB_SLEEP s).
SANITIZER = """#!/usr/bin/env bash
echo "ARGS: $*"
[ -n "${STUB_SLEEP:-}" ] && sleep "$STUB_SLEEP"
echo "3 passed in 1.0s"
echo "========= ERROR SUMMARY: 0 errors"
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, text in (("compute-sanitizer", SANITIZER),
                       ("nvidia-smi", "#!/usr/bin/env bash\necho stub GPU\n"),
                       ("python3", "#!/usr/bin/env bash\necho stub python3\n")):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    full = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", **env}
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *args], env=full,
                          capture_output=True, text=True, timeout=60)


def _sanitizer_args(tmp_path: Path, tool: str) -> str:
    log = (tmp_path / "out" / f"{tool}.log").read_text()
    return next(line for line in log.splitlines() if line.startswith("ARGS: "))


def test_each_sanitizer_stage_runs_one_tool_over_the_cupy_ports(tmp_path):
    run = _run(tmp_path, "--stage", "sanitizer-initcheck")
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu.txt", "initcheck.log"]
    args = _sanitizer_args(tmp_path, "initcheck")
    assert "--tool initcheck" in args
    for port in ("apex", "paddle", "oneflow", "te", "leetcuda", "fastrope", "vllm_port",
                 "flashinfer_port", "sglang", "vllm_qknorm", "flashinfer_qknorm"):
        assert f"tests/test_gpu_{port}.py" in args
    for other in ("hf", "qknorm", "triton_seeds", "fastrope_torch", "peers", "crossval",
                  "context_parallel"):
        assert f"tests/test_gpu_{other}.py" not in args
    assert "-k not test_more_than_2_31_elements and not test_offsets_more_than_2_31" in args


def test_racecheck_takes_the_shared_memory_kernels(tmp_path):
    assert _run(tmp_path, "--stage", "sanitizer-racecheck").returncode == 0
    args = _sanitizer_args(tmp_path, "racecheck")
    assert ("pytest tests/test_gpu_te.py tests/test_gpu_fastrope.py tests/test_gpu_vllm_qknorm.py -q"
            in args)


def test_sanitizer_runs_the_chosen_tools_in_turn(tmp_path):
    run = _run(tmp_path, "--stage", "sanitizer", SANITIZER_TOOLS="racecheck memcheck")
    assert run.returncode == 0, run.stderr
    assert run.stdout.index("== compute-sanitizer racecheck") < run.stdout.index(
        "== compute-sanitizer memcheck")
    assert not (tmp_path / "out" / "initcheck.log").exists()


@pytest.mark.parametrize("args, env, words", [
    (("--stage", "sanitizer-leakcheck"), {}, "unknown stage sanitizer-leakcheck"),
    (("--stage", "sanitizer"), {"SANITIZER_TOOLS": "initcheck synccheck"},
     "unknown SANITIZER_TOOLS entry synccheck; choose from memcheck initcheck racecheck"),
])
def test_bad_names_are_one_line_and_exit_2(tmp_path, args, env, words):
    run = _run(tmp_path, *args, **env)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and words in lines[0]
    assert not (tmp_path / "out").exists()  # refused before any work


def test_an_overrun_is_cut_and_fails_the_stage(tmp_path):
    run = _run(tmp_path, "--stage", "sanitizer-memcheck", STUB_SLEEP="10",
               SANITIZER_LIMIT_S="1")
    assert run.returncode == 1
    log = (tmp_path / "out" / "memcheck.log").read_text()
    assert "cut at 1 s" in log and "ERROR SUMMARY" not in log
    assert "cut at 1 s" in run.stdout
