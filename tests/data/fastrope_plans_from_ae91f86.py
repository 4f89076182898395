"""Write tests/data/fastrope_plans.json.gz: the launches of the code at ae91f86 (before the launch
plan became a table) for tests/fastrope_plan_cases.py's problems, design and ablations.

Run once from the repository root against that commit's package::

    mkdir /tmp/ae91f86 && git archive ae91f86 ports reference | tar -x -C /tmp/ae91f86
    PYTHONPATH=/tmp/ae91f86:tests python tests/data/fastrope_plans_from_ae91f86.py

It reads ablation.Tuning, which that commit's ablations were made of; the registry rows'
tunings are copied from its ports/fastrope/canonical.py.
"""
from __future__ import annotations

import gzip
import json
import pathlib

import fastrope_plan_cases as C
from ports.fastrope import ablation, kernel, launcher, plan, run

# ae91f86's canonical._ablations: registry name -> Tuning keywords (full_tables: the case's
# [L, R] tables, no tuning; fp32_angles: computed angles only).
ABLATIONS = {
    "scalar_access": dict(vector_cap=1),
    "one_half_per_thread": dict(one_half_per_thread=True),
    "table_per_head": dict(flags=kernel.RELOAD_TABLE),
    "one_head_per_step": dict(unroll=1),
    "wide_steps_past_l2": dict(vector_cap=8, unroll=4),
    "fixed_launch": dict(shape_rule="fixed"),
    "divmod_index": dict(flags=kernel.DIVIDE),
    "no_cache_hints": dict(flags=kernel.NO_CACHE_HINTS),
    "int64_index": dict(index_bits=64),
    "no_step_kernel": dict(step_kernel=False),
    "runtime_switches": dict(runtime_switches=True),
    "separate_launches": dict(separate_launches=True),
    "sequence_per_block_row": dict(memory_order=False),
    "fp32_angles": dict(flags=kernel.ANGLE_FP32),
}


def main():
    launches = C.fake_device(setattr, plan=plan, kernel=kernel, launcher=launcher)

    def design(xs, kw):
        run._ENTRIES.clear()
        run.rotate(*xs, in_place=kw.pop("in_place"), **kw)

    def tuned(tuning):
        def call(xs, kw):
            run._ENTRIES.clear()
            run.rotate(*xs, in_place=kw.pop("in_place"), tuning=tuning, **kw)
        return call

    records = []
    for case in C.cases():
        xs, kw = C.arguments(case)
        records.append(dict(case=case, ablation=None,
                            launches=C.outcome(design, xs, dict(kw, in_place=case["in_place"]),
                                               launches)))
    for name, tuning_kw in ABLATIONS.items():
        call = tuned(ablation.Tuning(**tuning_kw))
        for case in C.ablation_cases():
            if (name == "fp32_angles") != (case["tables"] == "computed"):
                continue
            xs, kw = C.arguments(case)
            records.append(dict(case=case, ablation=name, launches=C.outcome(
                call, xs, dict(kw, in_place=case["in_place"]), launches)))
    path = pathlib.Path(__file__).with_name("fastrope_plans.json.gz")
    text = json.dumps(records, indent=None, separators=(",", ":")) + "\n"
    path.write_bytes(gzip.compress(text.encode(), mtime=0))
    print(f"{len(records)} records -> {path}")


if __name__ == "__main__":
    main()
