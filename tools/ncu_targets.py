"""One launch each of fastrope (given tables, computed angles), torch.compile and a copy, after
warm-up, between cudaProfilerStart/Stop: what Nsight Compute profiles to compare their kernels
(registers, occupancy, memory throughput). (Needs a GPU and ncu.)

    ncu --profile-from-start off python -m tools.ncu_targets prefill   # bshd 4x4096x32x128 bf16
    ncu --profile-from-start off python -m tools.ncu_targets decode    # b=64 decode step, offsets
    ncu --profile-from-start off python -m tools.ncu_targets peers_long
        # the peers suite's 1x32768x32x128 bf16 case with k (harness inputs): fastrope (tables,
        # computed, in place), Liger, flash-attn, torch.compile and a copy of the same bytes
    ncu --profile-from-start off python -m tools.ncu_targets decode_step
        # the peers suite's bf16 decode steps at b = 1, 256 and 64 (harness inputs): fastrope's
        # step kernel (offsets tensor), the same with 4 heads per thread (the step_heads
        # ablation), the minimal kernel with the row through the offsets
        # (tools/decode_peers_probe.py) and Liger with its rows given, in that order per case
    ncu --profile-from-start off python -m tools.ncu_targets gaps
        # the two prefill-suite cases fastrope trails on (harness inputs): 1x32768x8x128 fp32
        # forward (fastrope, the same with 2 heads per step and plain accesses, flash-attn,
        # torch.compile) and 4x4096x32x128 bf16 backward (fastrope, torch.compile)

torch's same-dtype copy is a cudaMemcpy, which Nsight Compute does not profile: the targets that
run one get no row for it (2026-11-25, H100).
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


def _registry_calls(case, names, extra=()):
    """The registry's prepared calls (``extra``: more specs) on the case's harness inputs;
    unsupported or missing rows are skipped, said."""
    from ports import registry
    from reference.case import make_inputs

    inputs = make_inputs(case, 0, torch.device("cuda"))
    calls = []
    for spec in [registry.get(n) for n in names] + list(extra):
        reason = spec.unsupported_reason(case) or (getattr(spec, "missing", None) or
                                                   (lambda: None))()
        if reason:
            print(f"skipped {spec.name}: {reason}")
        else:
            calls.append(spec.prepare(case, inputs))
    return calls


def gaps():
    from ports.fastrope import kernel
    from ports.fastrope.canonical import _ablation
    from ports.harness.suites import get_suite

    prefill = get_suite("prefill")
    long = next(c for c in prefill if c.layout == "bshd" and c.seqlen == 32768
                and c.dtype == "fp32")
    wide = next(c for c in prefill if c.layout == "bshd" and c.batch == 4 and c.dtype == "bf16")
    plain2 = _ablation("u2_plain", "2 heads per step, plain accesses",
                       dict(unroll=2, flags=kernel.NO_CACHE_HINTS))
    calls = _registry_calls(long, ("fastrope.rope", "flash_attn.apply_rotary",
                                   "torch.compile(hf_rotate_half)"), [plain2])
    calls += _registry_calls(wide.replace(direction="backward"),
                             ("fastrope.rope", "torch.compile(hf_rotate_half)"))
    _profile(calls)


def decode_step():
    import cupy

    from ports import registry
    from ports.fastrope.canonical import _ablation
    from ports.harness.suites import get_suite
    from reference.case import make_inputs
    from tools.decode_peers_probe import MINIMAL_SRC

    mod = cupy.RawModule(code=MINIMAL_SRC, options=("-std=c++17",),
                         name_expressions=["minimal<true>"])
    minimal = mod.get_function("minimal<true>")
    four = _ablation("step_h4", "4 heads per step-kernel thread", dict(step_heads=4))
    calls = []
    for case in get_suite("peers"):
        if case.seqlen != 1 or case.dtype != "bf16":
            continue
        inputs = make_inputs(case, 0, torch.device("cuda"))
        q, k = [x.clone() for x in inputs.xs]
        b, hq, hk = q.shape[0], q.shape[2], k.shape[2]

        def launch(q=q, k=k, b=b, hq=hq, hk=hk, inputs=inputs):
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                minimal((1, b, 2), (8, -(-(hq + hk) // 2), 1),
                        (q.data_ptr(), k.data_ptr(), inputs.cos.data_ptr(),
                         inputs.sin.data_ptr(), inputs.offsets.data_ptr(), hq, hk))

        calls += [registry.get("fastrope.rope").prepare(case, inputs),
                  four.prepare(case, inputs), launch]
        liger = registry.get("liger.rope")
        reason = liger.unsupported_reason(case) or liger.missing()
        if reason:
            print(f"skipped liger.rope: {reason}")
        else:
            calls.append(liger.prepare(case, inputs))
    _profile(calls)


TARGETS = {"prefill": prefill, "decode": decode, "peers_long": peers_long,
           "decode_step": decode_step, "gaps": gaps}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: python -m tools.ncu_targets {{{','.join(TARGETS)}}}")
    TARGETS[sys.argv[1]]()
