"""One launch each of fastrope (given tables, computed angles), torch.compile and a copy, after
warm-up, between cudaProfilerStart/Stop: what Nsight Compute profiles to compare their kernels
(registers, occupancy, memory throughput). (Needs a GPU and ncu.)

    ncu --profile-from-start off python -m tools.ncu_targets prefill   # bshd 4x4096x32x128 bf16
    ncu --profile-from-start off python -m tools.ncu_targets decode    # b=64 decode step, offsets
"""
from __future__ import annotations

import sys

import torch

from ports.eager.canonical import _compiled_apply
from ports.fastrope import apply_rope
from tools._probe_kit import decode_inputs, make


def _profile(calls) -> None:
    """Warm each call up, then run each once inside the profiled range."""
    for _ in range(3):
        for f in calls:
            f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for f in calls:
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def prefill(layout="bshd", shape=(4, 4096, 32, 128), dtype=torch.bfloat16):
    x, cos, sin = make(layout, shape, dtype)
    rows = cos[None, :, :] if layout == "bshd" else cos[:, None, :]
    srows = sin[None, :, :] if layout == "bshd" else sin[:, None, :]
    comp = _compiled_apply()
    same = torch.empty_like(x)
    _profile([lambda: apply_rope(x, cos=cos, sin=sin, layout=layout, check_positions=False),
              lambda: apply_rope(x, layout=layout),
              lambda: comp(x, None, rows, srows, 2),
              lambda: same.copy_(x)])


def decode():
    x, cos, sin, offs, rows, srows = decode_inputs()
    comp = _compiled_apply()
    _profile([lambda: comp(x, None, rows, srows, 2),
              lambda: apply_rope(x, cos=cos, sin=sin, offsets=offs, check_positions=False)])


TARGETS = {"prefill": prefill, "decode": decode}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: python -m tools.ncu_targets {{{','.join(TARGETS)}}}")
    TARGETS[sys.argv[1]]()
