"""Does fastrope beat the production peers on the peers suite's cases, and which of its launch
choices makes the difference? (Needs a GPU.)

``decode``: the peers suite's bf16 decode cases (GQA k with 8 heads, tables in x's dtype, one
offset per sequence in a 4k context) at b = 1, 64 and 256 (64 q heads at 256), CUDA-graph
timed: the design (the step kernel at these sizes), the same with full-width tables (the
``full_tables`` ablation), the main kernel (the ``no_step_kernel``
ablation), the step kernel reading its switches at run time, with streaming hints (the design
drops them at these sizes), with 2 or 4 heads per thread, and with a
token's heads in the fewest blocks (b = 1: 2 blocks, not 10), beside the installed peers and
the launch floor (a one-element fill).

``minimal``: the same decode steps against minimal kernels in the step kernel's shape (grid
(1, B, 2), 8 threads per head, both halves of a 16-byte chunk, in place): the data and a fixed
table row (xor for math), the same with the row through the offsets (the dependent load);
beside fastrope with an offsets tensor, with an int offset, and with an offsets tensor and its
switches read at run time, Liger with its rows given and after its own gather, and the launch
floor.

``prefill``: the suite's bf16 rotate-half cases of at least 2^20 token-heads, event timed: the
design, computed angles, 1, 2 or 8 heads per step, plain loads and stores, a thread owning one
half (loading its partner), and the step kernel forced at every size (out of place and in place), beside the peers.

``band``: the step kernel's L2-sized band in place: the prefill suite's 16-bit 1x4096x32 and
1x32768x8 cases (bshd and sbhd) and the peers suite's bf16 case with k at 2048-6144 tokens,
CUDA-graph timed: the design (``plan.step_heads_per_thread``) against 1, 2 and 4 heads per thread
(the ``step_heads`` ablation, in place), beside flash-attn's in-place kernel and Liger.

``large``: out of place past the L2: the prefill suite's 16-bit 4x4096x32 (both layouts),
bshd 8x4096x64 bf16, 1x32768x8 bf16 and fp32 and 4x4096x32 fp32, and the peers suite's prefill
cases of at least 16384 tokens, CUDA-graph timed: the design against plain loads and stores and
2 heads per step, beside flash-attn and torch.compile.

Everything runs through the harness (equal inputs, validated against the float64 oracle). Each
value is the minimum over ``reps`` rounds of the median, rounds interleaved across cases.

    python -m tools.decode_peers_probe [decode] [minimal] [prefill] [band] [large] [--reps N]
"""
from __future__ import annotations

import dataclasses
import sys
from unittest import mock

from ports import registry
from ports.fastrope import ablation, kernel, plan
from ports.fastrope.ablation import Tuning
from ports.fastrope.canonical import _ablation, _preparer
from ports.harness.runner import run_case
from ports.harness.suites import get_suite
from tools._probe_kit import run_named

PEERS = ("liger.rope", "flash_attn.apply_rotary", "flash_attn.apply_rotary_inplace",
         "torch.compile(hf_rotate_half)")
REPS = 3
RUNTIME = Tuning(runtime_switches=True)


def _huge_gpu():
    """Plan as if the GPU were huge (the step kernel takes every size)."""
    return mock.patch.object(plan, "sm_count", lambda index: 1 << 20)


def _fewest_step_blocks():
    """The step kernel's heads in the fewest blocks of <= 256 threads, whatever the tokens."""
    return mock.patch.object(plan, "step_head_blocks", lambda htot, chunks, heads, tokens, sms:
                             -(-htot // (plan.THREADS_PER_BLOCK // chunks * heads)))


def _table(title, cases, specs, patched, graph):
    """Run every case ``REPS`` times; ``patched`` pairs a patch (``_huge_gpu``, ...) with the
    specs that run under it. Print implementations x cases."""
    best: dict = {}
    forced = [s for _, group in patched for s in group]
    for _ in range(REPS):
        for case in cases:
            results = run_case(case, specs, graph=graph).results
            for patch, group in patched:
                with patch():
                    results += run_case(case, group, graph=graph).results
            for r in results:
                key = (case.describe(), r.impl)
                v = r.graph_us if graph else r.median_us
                if r.status != "ok" or v is None:
                    best.setdefault(key, f"{r.status} {(r.reason or '')[:50]}")
                elif not isinstance(best.get(key), float) or v < best[key]:
                    best[key] = v
    print(f"\n## {title}: {'graph' if graph else 'event'} us, min of {REPS} medians")
    for c in cases:
        print(f"- {c.describe()}")
    print("| impl | " + " | ".join(f"{c.batch}x{c.seqlen}x{c.heads} {c.dtype}" for c in cases)
          + " |")
    print("|---|" + "---|" * len(cases))
    for n in [s.name for s in specs + forced]:
        cells = [best.get((c.describe(), n)) for c in cases]
        print(f"| {n} | " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v)
                                       for v in cells) + " |")


def _variants(named: dict) -> list:
    return [_ablation(name, name, kw) for name, kw in named.items()]


def decode():
    cases = [c for c in get_suite("peers") if c.seqlen == 1 and c.dtype == "bf16"]
    specs = [registry.get(n) for n in ("fastrope.rope", "fastrope.rope_inplace",
                                       "fastrope-ablation.full_tables",
                                       "fastrope-ablation.no_step_kernel") + PEERS]
    specs += _variants({
        "step_runtime_switches": dict(runtime_switches=True),
        "step_hints": dict(hints_at_every_size=True),
        "step_h1": dict(step_heads=1), "step_h2": dict(step_heads=2),
        "step_h4": dict(step_heads=4),
        "step_h1_hints": dict(step_heads=1, hints_at_every_size=True),
    })
    fewest = [_ablation("step_fewest_blocks", "the step kernel's heads in the fewest blocks", {}),
              _ablation("step_h2_fewest_blocks", "2 heads per thread, the fewest blocks",
                        dict(step_heads=2))]
    _table("decode", cases, specs, [(_fewest_step_blocks, fewest)], graph=True)
    _floor()


def _floor():
    """The CUDA-graph time of the smallest kernel there is (a one-element fill): the launch
    floor every decode row sits on."""
    import torch
    from ports.harness.timing import graph_median_us

    one = torch.empty(1, device="cuda")
    print(f"\nfloor: one-element fill, graph us: "
          f"{min(graph_median_us(one.zero_) for _ in range(REPS)):.2f}")


MINIMAL_SRC = r'''
template <bool THROUGH_OFFSETS>
__global__ void minimal(uint4* q, uint4* k, const uint4* cos, const uint4* sin,
                        const long long* offs, int hq, int hk) {
  const int b = blockIdx.y, chunk = threadIdx.x;
  const int h = blockIdx.z * blockDim.y + threadIdx.y;
  if (h >= hq + hk) return;
  uint4* row = h >= hq ? k + ((long long)b * hk + (h - hq)) * 16 : q + ((long long)b * hq + h) * 16;
  uint4 x = row[chunk], y = row[chunk + 8];
  const long long r = THROUGH_OFFSETS ? offs[b] : 7;
  const uint4 ca = cos[r * 16 + chunk], cb = cos[r * 16 + chunk + 8];
  const uint4 sa = sin[r * 16 + chunk], sb = sin[r * 16 + chunk + 8];
  x.x ^= ca.x ^ sa.y; x.y ^= ca.y ^ sa.x; x.z ^= ca.z ^ sa.w; x.w ^= ca.w ^ sa.z;
  y.x ^= cb.x ^ sb.y; y.y ^= cb.y ^ sb.x; y.z ^= cb.z ^ sb.w; y.w ^= cb.w ^ sb.z;
  row[chunk] = x; row[chunk + 8] = y;
}
'''


def minimal():
    import cupy
    import torch

    from ports.fastrope import apply_rope_inplace
    from ports.harness.timing import graph_median_us
    from reference.case import make_inputs

    mod = cupy.RawModule(code=MINIMAL_SRC, options=("-std=c++17",),
                         name_expressions=["minimal<false>", "minimal<true>"])
    kernels = {"minimal: data + a fixed table row": mod.get_function("minimal<false>"),
               "minimal: the row through the offsets": mod.get_function("minimal<true>")}
    liger = _liger_rope()
    for case in [c for c in get_suite("peers") if c.seqlen == 1 and c.dtype == "bf16"]:
        inputs = make_inputs(case, 0, torch.device("cuda"))
        q, k = [x.clone() for x in inputs.xs]
        b, hq, hk = q.shape[0], q.shape[2], k.shape[2]
        cos, sin, offs = inputs.cos, inputs.sin, inputs.offsets
        assert cos.shape[1] == 128 and cos.dtype == torch.bfloat16 and cos.is_contiguous()

        def launch(kern):
            def call():
                with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    kern((1, b, 2), (8, -(-(hq + hk) // 2), 1),
                         (q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                          offs.data_ptr(), hq, hk))
            return call

        calls = {name: launch(kern) for name, kern in kernels.items()}
        kw = dict(cos=cos, sin=sin, check_positions=False)
        calls["fastrope step kernel, offsets tensor"] = \
            lambda: apply_rope_inplace(q, k, offsets=offs, **kw)
        calls["fastrope step kernel, int offset"] = \
            lambda: apply_rope_inplace(q, k, offsets=1000, **kw)
        calls["fastrope step kernel, offsets tensor, switches read at run time"] = \
            lambda: ablation.apply_rope_inplace(q, k, offsets=offs, tuning=RUNTIME, **kw)
        calls["liger.rope (rows given)"] = registry.get("liger.rope").prepare(case, inputs)
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        calls["liger after its own gather"] = \
            lambda: liger(qt, kt, cos[inputs.positions], sin[inputs.positions])
        one = torch.empty(1, device="cuda")
        calls["floor: a one-element fill"] = one.zero_
        print(f"\n## {case.describe()}: graph us, min of {REPS} medians")
        for name, call in calls.items():
            print(f"| {name} | {min(graph_median_us(call) for _ in range(REPS)):.2f} |")


def _liger_rope():
    from ports.peers.canonical import _liger

    return _liger().LigerRopeFunction.apply


def prefill():
    cases = [c for c in get_suite("peers") if c.seqlen > 1 and c.style == "rotate_half"
             and c.batch * c.seqlen * c.heads >= 1 << 20 and c.dtype == "bf16"]
    specs = [registry.get(n) for n in ("fastrope.rope", "fastrope.rope_inplace",
                                       "fastrope.rope_computed") + PEERS]
    specs += _variants({
        "u2": dict(unroll=2), "u1": dict(unroll=1), "u8": dict(unroll=8),
        "no_hints": dict(flags=kernel.NO_CACHE_HINTS), "one_half": dict(one_half_per_thread=True),
    })
    forced = _ablation("step_everywhere", "step kernel at every size", dict(vector_cap=16))
    forced_ip = dataclasses.replace(forced, name="fastrope-ablation.step_everywhere_inplace",
                                    prepare=_preparer(in_place=True,
                                                      tuning=Tuning(vector_cap=16)))
    _table("prefill", cases, specs, [(_huge_gpu, [forced, forced_ip])], graph=False)


def band():
    prefill_cases = [c for c in get_suite("prefill") if c.dtype != "fp32"
                     and c.batch * c.seqlen * c.heads in (4096 * 32, 32768 * 8)]
    peers = next(c for c in get_suite("peers") if c.batch == 1 and c.seqlen == 4096)
    cases = prefill_cases + [peers.replace(seqlen=s) for s in (2048, 3072, 4096, 5120, 6144)]
    specs = [registry.get(n) for n in ("fastrope.rope_inplace", "flash_attn.apply_rotary_inplace",
                                       "liger.rope")]
    for heads in (1, 2, 4):
        tuning = Tuning(step_heads=heads)
        spec = _ablation(f"step_h{heads}", f"{heads} heads per step-kernel thread",
                         dict(step_heads=heads))
        specs.append(dataclasses.replace(spec, name=f"{spec.name}_inplace",
                                         prepare=_preparer(in_place=True, tuning=tuning)))
    _table("the step kernel's band, in place", cases, specs, [], graph=True)


def large():
    prefill_cases = get_suite("prefill")
    cases = [c for c in prefill_cases if (c.batch, c.seqlen) == (4, 4096) and c.dtype != "fp32"]
    cases += [c for c in prefill_cases if c.layout == "bshd" and (
        (c.batch, c.heads, c.dtype) == (8, 64, "bf16") or (c.seqlen == 32768 and c.dtype != "fp16")
        or ((c.batch, c.seqlen, c.dtype) == (4, 4096, "fp32")))]
    cases += [c for c in get_suite("peers") if c.seqlen >= 4096 and c.batch * c.seqlen >= 16384]
    specs = [registry.get(n) for n in ("fastrope.rope", "flash_attn.apply_rotary",
                                       "torch.compile(hf_rotate_half)")]
    specs += _variants({"no_hints": dict(flags=kernel.NO_CACHE_HINTS), "u2": dict(unroll=2)})
    _table("prefill past the L2, out of place", cases, specs, [], graph=True)


PROBES = {"decode": decode, "minimal": minimal, "prefill": prefill, "band": band, "large": large}

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--reps" in args:
        i = args.index("--reps")
        REPS = int(args[i + 1])
        del args[i:i + 2]
    run_named(PROBES, args)
