"""Two runs of one suite side by side: each (case, implementation)'s time before and after a change.

    python tools/before_after.py BEFORE.json AFTER.json [--value graph_us] [--csv OUT.csv]

Reads the JSON that ``compare.py --json`` writes (one row per case and implementation), pairs the
rows by case and implementation name, and prints a markdown table of the value before, after and
their ratio (after / before), then the ratios' median and extremes, and whether each pair's
status agrees. Used to show that a refactor keeps the kernels' times (run both on one machine).
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys


def load(path: str) -> dict[tuple[str, str], dict]:
    with open(path) as f:
        rows = json.load(f)
    return {(r["case"], r["impl"]): r for r in rows}


def pairs(before: dict, after: dict, value: str) -> list[dict]:
    out = []
    for key in before.keys() & after.keys():
        b, a = before[key].get(value), after[key].get(value)
        out.append({"case": key[0], "impl": key[1], "before": b, "after": a,
                    "ratio": a / b if a and b else None,
                    "status": before[key]["status"] + ("" if before[key]["status"] ==
                                                      after[key]["status"]
                                                      else f" -> {after[key]['status']}")})
    return sorted(out, key=lambda r: (r["case"], r["impl"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--value", default="graph_us", help="the column to compare (default graph_us)")
    ap.add_argument("--csv", help="also write the pairs to this CSV file")
    args = ap.parse_args(argv)
    rows = pairs(load(args.before), load(args.after), args.value)
    if not rows:
        print("the two runs share no (case, implementation) pair", file=sys.stderr)
        return 2
    print("| case | implementation | before | after | after / before | status |")
    print("|---|---|---|---|---|---|")
    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"| {r['case']} | {r['impl']} | {fmt(r['before'])} | {fmt(r['after'])} | {ratio} "
              f"| {r['status']} |")
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    if ratios:
        print(f"\n{len(ratios)} pairs timed: after / before median "
              f"{statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    changed = [r for r in rows if "->" in r["status"]]
    print(f"{len(changed)} pairs changed status")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
