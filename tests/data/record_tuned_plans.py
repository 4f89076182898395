"""Write tests/data/fastrope_tuned_plans.json: for each shipped tuning table
(ports/fastrope/tuned), a digest of the launches fastrope makes for each problem of
tests/fastrope_plan_cases.py (in its order) on a GPU of that family.

The results/ tables measured on a GPU describe the launches pinned here. When a change moves a
family's launches, tests/test_fastrope_plans.py fails: that GPU's tables predate the change.
Re-record from the repository root, and say in results/ which GPU's tables it leaves behind:

    PYTHONPATH=.:tests python tests/data/record_tuned_plans.py
"""
from __future__ import annotations

import json
import pathlib

import fastrope_plan_cases as C
from ports.fastrope import kernel, launcher, plan, run, tuning


def main() -> None:
    saved = []

    def setattr_undoable(module, name, value):
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    out = {}
    for family, table in sorted(tuning.tables().items()):
        try:
            out[family] = C.tuned_digests(setattr_undoable, table, plan=plan, kernel=kernel,
                                          launcher=launcher, run=run)
        finally:
            for module, name, value in reversed(saved):
                setattr(module, name, value)
            saved.clear()
    path = pathlib.Path(__file__).with_name("fastrope_tuned_plans.json")
    path.write_text(json.dumps(out, indent=0, sort_keys=True).replace('",\n"', '", "') + "\n",
                    encoding="utf-8")
    print(f"wrote {path}: {', '.join(f'{f}: {len(d)} problems' for f, d in out.items())}")


if __name__ == "__main__":
    main()
