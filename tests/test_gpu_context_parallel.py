"""Context parallelism on 2 GPUs: fastrope on each rank's shard, gathered through NCCL, equals
fastrope on the whole batch on one GPU, bit for bit, forward and backward.

Launches tests/_cp_worker.py under torchrun with one process per GPU. Its cases: split scheme
(contiguous, zigzag) x layout (bshd; thd with uneven lengths) x dtype (bf16, fp32), GQA k,
asymmetric cos/sin tables, a random dy. The same worker runs on the CPU with gloo and the
reference rotation in tests/test_context_parallel.py.
"""
from __future__ import annotations

import subprocess

import pytest
import torch
from _cp_worker import ROOT, torchrun_command

pytestmark = pytest.mark.gpu


def test_two_gpus_equal_one_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (one per rank); this machine has {torch.cuda.device_count()}")
    proc = subprocess.run(torchrun_command("nccl"), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    print(proc.stdout)  # the per-case lines, for the log (pytest -s or -rP)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("context parallel: 2 ranks, nccl, rotation by fastrope")
    assert len(lines) == 2 + 2 * 2 * 2, proc.stdout
    assert all(line.endswith("q equal, k equal, dq equal, dk equal") for line in lines[1:-1])
    assert lines[-1] == "all equal"
