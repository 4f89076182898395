"""fastrope's main-kernel plan, swept on the prefills past the L2 (needs a GPU).

For each case (q only, or q with a GQA k of 8 heads; half-width tables in x's dtype, the same
tensors for every row) and mode, the design (the device's tuning table) is timed beside fixed
plans from the experiment interface: heads per step (16-byte accesses), the 16-bit row's
alternatives, head splits, a ``__launch_bounds__`` minimum of resident blocks, plain accesses, a
thread per half (the one_half_per_thread ablation);
and beside torch.compile of the HF rotation (the prefill suite's row: the full-width tables of the
same angles) and a same-size copy.
CUDA-graph us, the minimum of 3 interleaved medians; each fastrope row's output is checked
against the design's: bit for bit, or to rounding where its math order differs. One JSON line
per (case, mode) row, and a markdown table:

    python -m tools.plan_sweep_probe [--json FILE] [--cases I ...] [--only SETUP ...]
"""
from __future__ import annotations

import argparse
import json

import torch

from ports import registry
from ports.fastrope import experiment
from ports.harness.timing import copy_us, graph_median_us, min_of_interleaved
from reference.case import RopeCase, make_inputs
from reference.tables import first_members

ROW16 = "16-bit past the L2: 8-byte accesses, 2 or 4 heads"
COMPILED = "torch.compile(hf_rotate_half)"


def _case(b, s, h, dtype, kv=None):
    return RopeCase(b, s, h, 128, dtype=dtype, cos_sin_dtype="same", kv_heads=kv, label="sweep")


CASES = (_case(4, 4096, 32, "bf16"), _case(8, 4096, 64, "bf16"), _case(4, 4096, 32, "fp32"),
         _case(8, 4096, 64, "fp32"), _case(1, 32768, 8, "bf16"), _case(1, 32768, 8, "fp32"),
         _case(8, 4096, 64, "bf16", 8), _case(1, 32768, 32, "bf16", 8))

# name -> experiment.apply_rope keyword arguments (besides the inputs)
SETUPS = {
    "design": {},
    "rules": dict(choices={}),
    "u1": dict(unroll=1), "u2": dict(unroll=2), "u4": dict(unroll=4), "u8": dict(unroll=8),
    "8B u4": dict(choices={ROW16: "8-byte accesses, 4 heads"}),
    "8B u2": dict(choices={ROW16: "8-byte accesses, 2 heads"}),
    "split2": dict(head_splits=2), "split4": dict(head_splits=4),
    "mb2": dict(variant=experiment.Variant(min_blocks=2)),
    "mb4": dict(variant=experiment.Variant(min_blocks=4)),
    "u2 mb4": dict(unroll=2, variant=experiment.Variant(min_blocks=4)),
    "plain": dict(choices={"streaming past the L2": "plain accesses"}),
    # rotate-half out of place with a thread per half that loads its partner: every store of a
    # warp contiguous, as torch.compile's flat kernel writes them
    "half": dict(ablation="one_half_per_thread"),
}


def _plan_text(plans):
    return "; ".join(f"{p.grid}x{p.block} V{p.vector} u{p.unroll}" for p in plans)


def sweep(case, in_place, setups):
    inputs = make_inputs(case, seed=0, device="cuda")
    kw = dict(cos=first_members(inputs.cos, case.style).contiguous(),
              sin=first_members(inputs.sin, case.style).contiguous(), check_positions=False)
    calls, plans = {}, {}
    expect = experiment.apply_rope(*inputs.xs, **kw)
    expect = expect if isinstance(expect, tuple) else (expect,)
    for name, extra in setups.items():
        xs = [x.clone() for x in inputs.xs] if in_place else list(inputs.xs)
        try:
            plans[name] = _plan_text(experiment.plans(*[x.clone() for x in xs], in_place=in_place,
                                                      **extra, **kw))
            outs = experiment.apply_rope(*[x.clone() for x in xs], in_place=in_place, **extra,
                                         **kw)
        except Exception as e:  # a setup that does not apply: say so
            plans[name] = f"refused: {e}"
            continue
        outs = outs if isinstance(outs, tuple) else (outs,)
        if not all(torch.equal(o, e) for o, e in zip(outs, expect)):
            # another math order (a thread per half): the design's values to rounding
            for o, e in zip(outs, expect):
                torch.testing.assert_close(o, e, msg=lambda m: f"{name}: {m}")
            plans[name] += " (not bit-equal to the design; equal to rounding)"
        calls[name] = (lambda xs=xs, extra=extra:
                       experiment.apply_rope(*xs, in_place=in_place, **extra, **kw))
    spec = registry.get(COMPILED)
    if not in_place and spec.unsupported_reason(case) is None:
        calls["compile"] = spec.prepare(case, inputs)
    times = min_of_interleaved(calls, timer=graph_median_us)
    times["copy"] = copy_us(case.io_bytes() // 2, graph=True)
    del inputs
    torch.cuda.empty_cache()
    return times, plans


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--only", nargs="*", help="setups to time (default all)")
    ap.add_argument("--cases", nargs="*", type=int, help="indices into CASES (default all)")
    args = ap.parse_args()
    setups = {k: v for k, v in SETUPS.items() if not args.only or k in args.only or k == "design"}
    rows = []
    cols = list(setups) + ["compile", "copy"]
    print("| case | mode | " + " | ".join(cols) + " |")
    for case in [CASES[i] for i in args.cases] if args.cases else CASES:
        for in_place in (False, True):
            times, plans = sweep(case, in_place, setups)
            mode = "in" if in_place else "out"
            rows.append(dict(case=case.describe(), mode=mode, times=times, plans=plans,
                             gpu=torch.cuda.get_device_name()))
            print(f"| {case.describe()} | {mode} | " + " | ".join(
                f"{times[c]:.1f}" if c in times else "-" for c in cols) + " |", flush=True)
            if args.json:  # after every row: a cut run keeps what it timed
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
