"""One launch each of fastrope (given tables, computed angles), torch.compile and a copy, after
warm-up, between cudaProfilerStart/Stop: what Nsight Compute profiles to compare their kernels
(registers, occupancy, memory throughput). (Needs a GPU and ncu.)

    ncu --profile-from-start off python -m tools.ncu_targets prefill   # bshd 4x4096x32x128 bf16
    ncu --profile-from-start off python -m tools.ncu_targets decode    # b=64 decode step, offsets
    ncu --profile-from-start off python -m tools.ncu_targets peers_long
        # the peers suite's 1x32768x32x128 bf16 case with k (harness inputs): fastrope (tables,
        # computed, in place), Liger, flash-attn, torch.compile and a copy of the same bytes
    ncu --profile-from-start off --kernel-name regex:qk_norm_rope python -m tools.ncu_targets \
        qknorm_train        # qk_norm_rope's forward and backward, the qknorm suite's 4 x 4k shape
    ncu --profile-from-start off --kernel-name regex:qk_ python -m tools.ncu_targets \
        qknorm_token_forward  # the same shape's forward out of place, OLMo2's norm over a
                              # token's heads (norm="token") beside Qwen3's per head
    ncu --profile-from-start off --kernel-name regex:qk_token python -m tools.ncu_targets \
        qknorm_token_backward  # OLMo2's norm, forward + backward, at 4k and 4 x 4k tokens

torch's same-dtype copy is a cudaMemcpy, which Nsight Compute does not profile: the targets that
run one get no row for it (2026-11-25, H100).
"""
from __future__ import annotations

import sys

import torch

from ports.fastrope import apply_rope
from reference import eager
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
    comp = torch.compile(eager.hf_apply_rotary_pos_emb, dynamic=False)
    same = torch.empty_like(x)
    _profile([lambda: apply_rope(x, cos=cos, sin=sin, layout=layout, check_positions=False),
              lambda: apply_rope(x, layout=layout),
              lambda: comp(x, None, rows, srows, 2),
              lambda: same.copy_(x)])


def decode():
    x, cos, sin, offs, rows, srows = decode_inputs()
    comp = torch.compile(eager.hf_apply_rotary_pos_emb, dynamic=False)
    _profile([lambda: comp(x, None, rows, srows, 2),
              lambda: apply_rope(x, cos=cos, sin=sin, offsets=offs, check_positions=False)])


def peers_long():
    from ports import registry
    from ports.harness.suites import get_suite
    from reference.case import make_inputs

    case = next(c for c in get_suite("peers") if c.batch == 1 and c.seqlen == 32768)
    inputs = make_inputs(case, 0, torch.device("cuda"))
    calls = []
    for name in ("fastrope.rope", "fastrope.rope_computed", "fastrope.rope_inplace", "liger.rope",
                 "flash_attn.apply_rotary", "torch.compile(hf_rotate_half)"):
        spec = registry.get(name)
        reason = spec.unsupported_reason(case)
        if reason:
            print(f"skipped {name}: {reason}")
        else:
            calls.append(spec.prepare(case, inputs))
    src = torch.empty(case.io_bytes() // 4, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    _profile(calls + [lambda: dst.copy_(src)])


def qknorm_train():
    from ports.fastrope.qknorm import qk_norm_rope
    from ports.harness import qknorm_bench as bench

    shape = next(s for s in bench.SHAPES if s.name == "qwen3-8b train 4x4k")
    q, k, qw, kw, cos, sin = bench.inputs(shape, torch.bfloat16, grad=True)
    outs = qk_norm_rope(q, k, qw, kw, bench.EPS, cos=cos, sin=sin)
    grads = [torch.randn_like(o) for o in outs]
    _profile([lambda: torch.autograd.grad(
        qk_norm_rope(q, k, qw, kw, bench.EPS, cos=cos, sin=sin), (q, k, qw, kw), grads)])


def qknorm_token_forward():
    from ports.fastrope.qknorm import qk_norm_rope
    from ports.harness import qknorm_bench as bench

    shape = next(s for s in bench.SHAPES if s.name == "qwen3-8b train 4x4k")
    q, k, qw, kw, cos, sin = bench.inputs(shape, torch.bfloat16, grad=False, norm="token")
    _, _, hw, hkw, _, _ = bench.inputs(shape, torch.bfloat16, grad=False)
    _profile([lambda: qk_norm_rope(q, k, qw, kw, bench.EPS, cos=cos, sin=sin, norm="token"),
              lambda: qk_norm_rope(q, k, hw, hkw, bench.EPS, cos=cos, sin=sin)])


def qknorm_token_backward():
    from ports.fastrope.qknorm import qk_norm_rope
    from ports.harness import qknorm_bench as bench

    calls = []
    for name in ("qwen3-8b prefill 4k", "qwen3-8b train 4x4k"):
        shape = next(s for s in bench.SHAPES if s.name == name)
        q, k, qw, kw, cos, sin = bench.inputs(shape, torch.bfloat16, grad=True, norm="token")
        outs = qk_norm_rope(q, k, qw, kw, bench.EPS, cos=cos, sin=sin, norm="token")
        grads = [torch.randn_like(o) for o in outs]
        calls.append(lambda q=q, k=k, qw=qw, kw=kw, cos=cos, sin=sin, grads=grads:
                     torch.autograd.grad(qk_norm_rope(q, k, qw, kw, bench.EPS, cos=cos, sin=sin,
                                                      norm="token"), (q, k, qw, kw), grads))
    _profile(calls)


TARGETS = {"prefill": prefill, "decode": decode, "peers_long": peers_long,
           "qknorm_train": qknorm_train, "qknorm_token_forward": qknorm_token_forward,
           "qknorm_token_backward": qknorm_token_backward}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: python -m tools.ncu_targets {{{','.join(TARGETS)}}}")
    TARGETS[sys.argv[1]]()
