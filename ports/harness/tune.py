"""``python -m ports.harness.tune``: fastrope's tuning table for the GPU it runs on.

Each row of fastrope's plan that has alternatives (``plan.ALTERNATIVES``) is timed on the cases
where it holds, its own settings against each alternative, on equal inputs: the same q, k where
the case has one (8 kv heads) and half-width tables in x's dtype, out of place and in place as the
row applies. A case whose plan an alternative leaves unchanged is not timed for it. Times are
CUDA-graph replays (median), ``--rounds`` rounds with the candidates of a case interleaved in
each; a candidate's ratio on a case is the median over rounds of its time over the row's own in
the same round.

An alternative is chosen for its row where it wins: geometric mean of its ratios at most
``1 - MARGIN`` and no case slower than ``1 + MARGIN``; of several winners, the best over every case
any of them changes (:func:`decide`); else the row's own. The cases are the peers suite's large
shapes with a GQA k and the prefill suite's q-only ones (:data:`TRIALS`). The table (family,
GPU, commit, the choices and every measurement) goes to ``--out`` (default
``ports/fastrope/tuned/<family>.json``, where fastrope reads it: ports.fastrope.tuning; ``--rows``
keeps the family's other rows there) and, with ``--json``, this run's scores as a results data
file (tools/results_tables.py renders it):

    python -m ports.harness.tune                        # write the device's table
    python -m ports.harness.tune --json results/data/tuning-h200.json --rounds 7
    python -m ports.harness.tune --rows "streaming past the L2"   # one row; the rest kept
    python -m ports.harness.tune --qknorm               # the fused QK-norm's constants

``--qknorm`` times the fused QK-norm's launch constants instead (:mod:`ports.harness.qknorm_tune`)
and writes them, decided by the same rule, as the table's ``qknorm`` entry (with
``qknorm_run``, ``qknorm_scores`` and ``qknorm_measurements``), keeping the plan's rows; a plan
run keeps the entry.

Needs an NVIDIA GPU; a few minutes on an H100 or an H200.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import shlex
import statistics
from dataclasses import dataclass

import torch

from reference.case import RopeCase

MARGIN = 0.01
ROUNDS = 5
REP_MS = 20


@dataclass(frozen=True)
class Trial:
    """One case a row is timed on: the case (q and its GQA k) and the mode."""

    case: RopeCase
    in_place: bool

    @property
    def label(self) -> str:
        b, s, h, d = self.case.batch, self.case.seqlen, self.case.heads, self.case.head_dim
        k = f" + k {self.case.kv_heads}" if self.case.kv_heads else ""
        mode = "in place" if self.in_place else "out of place"
        layout = "" if self.case.layout == "bshd" else f"{self.case.layout} "
        return f"{layout}{b}x{s}x{h}x{d}{k} {self.case.dtype} {mode}"


def _case(b: int, s: int, h: int, dtype: str, kv_heads: int | None = 8,
          layout: str = "bshd") -> RopeCase:
    return RopeCase(b, s, h, 128, layout=layout, dtype=dtype, cos_sin_dtype="same",
                    kv_heads=kv_heads, label="tune")


def _both(*cases: RopeCase) -> tuple[Trial, ...]:
    return tuple(Trial(c, m) for c in cases for m in (False, True))


# Past the L2 on an H100 or H200 (50 MiB): the peers suite's large 16-bit and fp32 shapes.
_LARGE_16 = (_case(4, 4096, 32, "bf16"), _case(8, 4096, 64, "bf16"), _case(1, 32768, 32, "bf16"),
             _case(4, 4096, 32, "fp16"))
_FP32 = (_case(1, 32768, 8, "fp32", None), _case(4, 4096, 32, "fp32"), _case(1, 32768, 32, "fp32"))
# The prefill suite's q-only shapes past the L2 (32 and 64 heads: no idle head slots at 2 or 4
# heads per step).
_Q_ONLY_16 = (_case(4, 4096, 32, "bf16", None), _case(8, 4096, 64, "bf16", None))
_Q_ONLY_FP32 = (_case(4, 4096, 32, "fp32", None), _case(8, 4096, 64, "fp32", None))
# The prefill suite's sbhd shapes with batches past the L2 (q only).
_SBHD = (_case(4, 4096, 32, "bf16", None, "sbhd"), _case(8, 4096, 64, "fp16", None, "sbhd"),
         _case(8, 4096, 64, "fp32", None, "sbhd"))
# 16-bit prefills that take the step kernel in place: L2-sized ones, and the q-only 1x32768x8
# just past the L2 (8 heads: 4 heads per thread leave blocks of 16 threads).
_STEP = (_case(1, 4096, 32, "bf16"), _case(1, 2048, 32, "bf16"), _case(1, 4096, 32, "fp16"),
         _case(1, 32768, 8, "bf16", None))

# Row of plan.RULES -> the trials it is tuned on.
TRIALS: dict[str, tuple[Trial, ...]] = {
    "step kernel below the work bound": _both(*_LARGE_16, *_FP32, *_Q_ONLY_16, *_Q_ONLY_FP32),
    # the q-only 1x32768x8 (a 67 MB input in 16 bits) is below the rows' bound, 1x32768x16
    # just above it, as the fp32 1x32768x8
    "out of place from twice the L2: token tiles": tuple(
        Trial(c, False) for c in (*_LARGE_16, *_Q_ONLY_16, _case(1, 32768, 8, "bf16", None),
                                  _case(1, 32768, 16, "bf16", None), *_FP32, *_Q_ONLY_FP32,
                                  *_SBHD)),
    "in place from twice the L2: token tiles": tuple(
        Trial(c, True) for c in (*_LARGE_16, *_Q_ONLY_16, _case(1, 32768, 8, "bf16", None),
                                 *_FP32, *_Q_ONLY_FP32, *_SBHD)),
    "streaming past the L2": (*_both(*_LARGE_16[:3], _FP32[1], _FP32[0],
                                     _case(1, 32768, 8, "bf16", None)),
                              *(Trial(c, False) for c in _Q_ONLY_FP32)),
    "several heads per step thread in place": tuple(Trial(c, True) for c in _STEP),
    "16-bit past the L2: 8-byte accesses, 2 or 4 heads": (
        *_both(*_LARGE_16, *_Q_ONLY_16), Trial(_case(1, 4096, 32, "bf16"), False)),
    "fp32 in place past the L2: 2 heads per step": tuple(
        Trial(c, True) for c in (*_FP32, *_Q_ONLY_FP32)),
    "fp32 out of place past the L2: heads per step from the work": tuple(
        Trial(c, False) for c in (*_FP32, *_Q_ONLY_FP32)),
}


def _geomean(xs) -> float:
    return math.exp(statistics.fmean(map(math.log, xs)))


def decide(ratios: dict[str, dict[str, float]], margin: float = MARGIN
           ) -> tuple[str | None, dict]:
    """The alternative a row takes from each alternative's ratio on each case where it changes
    the plan (None: the row's own), and each alternative's score there: geometric mean and
    worst ratio.

    An alternative wins where its geometric mean is at most ``1 - margin`` and no case is above
    ``1 + margin``. Of several winners the one taken is the best over every case any winner
    changes, a winner counting 1 where it leaves the plan as it is: one that gains as much on
    two cases as another on six is not ahead of it."""
    scores = {a: (_geomean(rs.values()), max(rs.values())) for a, rs in ratios.items() if rs}
    winners = [a for a, (g, worst) in scores.items() if g <= 1 - margin and worst <= 1 + margin]
    cases = {c for a in winners for c in ratios[a]}
    over_all = {a: _geomean([ratios[a].get(c, 1.0) for c in sorted(cases)]) for a in winners}
    return (min(winners, key=lambda a: (over_all[a], a)) if winners else None), scores


def table_name(family: str) -> str:
    """The file name of a family's table: its name in lower case, words joined by '-'."""
    return re.sub(r"[^a-z0-9.]+", "-", family.lower()).strip("-") + ".json"


def trial_inputs(trial: Trial):
    """A trial's inputs on the GPU (seed 0): x and its GQA k (copies for an in-place trial), and
    fastrope's keyword arguments: half-width tables in x's dtype, no position check."""
    from ports._adapters import half_width_tables
    from reference.case import make_inputs

    case = trial.case
    inputs = make_inputs(case, seed=0, device="cuda")
    cos, sin = half_width_tables(case, inputs)
    xs = [x.clone() for x in inputs.xs] if trial.in_place else list(inputs.xs)
    return xs, dict(cos=cos, sin=sin, check_positions=False)


def _measure(rows: list[str], rounds: int, rep_ms: int, progress) -> list[dict]:
    """Every (row, alternative, trial) time against the row's own, as measurement dicts."""
    from ports.fastrope import experiment, plan
    from ports.harness.timing import graph_median_us, paired_summary

    by_trial: dict[Trial, list[tuple[str, str]]] = {}
    for row in rows:
        for trial in TRIALS[row]:
            by_trial.setdefault(trial, []).extend((row, a) for a in plan.ALTERNATIVES[row])
    measurements = []
    for trial, candidates in by_trial.items():
        xs, kw = trial_inputs(trial)

        def call(choices, xs=xs, kw=kw, in_place=trial.in_place):
            return lambda: experiment.apply_rope(*xs, choices=choices, in_place=in_place, **kw)

        own = experiment.plans(*xs, choices={}, in_place=trial.in_place, **kw)
        timed = []
        for row, alternative in candidates:
            choice = {row: alternative}
            same = experiment.plans(*xs, choices=choice, in_place=trial.in_place, **kw) == own
            timed.append((row, alternative, None if same else call(choice)))
        design = call({})
        rounds_us: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(timed))}
        for _ in range(rounds):
            for i, (_, _, fn) in enumerate(timed):
                if fn is not None:
                    base = graph_median_us(design, rep_ms=rep_ms)
                    rounds_us[i].append((base, graph_median_us(fn, rep_ms=rep_ms)))
        for i, (row, alternative, fn) in enumerate(timed):
            entry = dict(row=row, alternative=alternative, case=trial.label)
            if fn is None:
                entry.update(same_plan=True)
            else:
                entry.update(same_plan=False, **paired_summary(rounds_us[i]))
            measurements.append(entry)
            progress(entry)
        del xs, kw
        torch.cuda.empty_cache()
    return measurements


def choose(measurements: list[dict], rows: list[str], margin: float = MARGIN,
           alternatives: dict[str, list[str]] | None = None):
    """The choices (row -> alternative) and the score rows the measurements give;
    ``alternatives``: each row's (default: plan.ALTERNATIVES)."""
    from ports.fastrope import plan

    alternatives = plan.ALTERNATIVES if alternatives is None else alternatives
    choices, scores = {}, []
    for row in rows:
        ratios = {a: {m["case"]: m["ratio"] for m in measurements
                      if m["row"] == row and m["alternative"] == a and not m["same_plan"]}
                  for a in alternatives[row]}
        chosen, score = decide(ratios, margin)
        if chosen is not None:
            choices[row] = chosen
        for a in alternatives[row]:
            g, worst = score.get(a, (None, None))
            scores.append(dict(row=row, alternative=a, cases=len(ratios[a]),
                               geomean=None if g is None else round(g, 4),
                               worst=None if worst is None else round(worst, 4),
                               chosen=a == chosen))
    return choices, scores


SCORE_COLUMNS = ["row", "alternative", "cases timed", "time / row's own (geomean)",
                 "worst case", "chosen"]


def runs(table: dict) -> list[dict]:
    """Which run measured which rows of a table: command, commit, GPU, date and rows."""
    if "runs" in table:
        return table["runs"]
    rows = [r for r in TRIALS if any(m["row"] == r for m in table.get("measurements", ()))]
    return [dict({k: table[k] for k in ("command", "commit", "gpu", "date") if k in table},
                 rows=rows)]


def keep_other_rows(old: dict, new: dict, rows: list[str]) -> dict:
    """``new``, a run over ``rows``, with the choices, scores and measurements of the family's
    other rows kept from ``old``, its earlier table (rows the plan still has); ``runs`` says which
    run measured which rows (so ``--rows`` re-times one row without dropping the others'
    choices)."""
    if old.get("family") != new["family"]:
        return new
    order = list(TRIALS)
    # a row the plan no longer has (renamed or removed) goes with its run's record of it
    earlier = [dict(run, rows=[r for r in run["rows"] if r not in rows and r in order])
               for run in runs(old)]
    earlier = [run for run in earlier if run["rows"]]
    other = {r for run in earlier for r in run["rows"]}

    def merged(key):
        kept = [x for x in old.get(key, ()) if x["row"] in other]
        return sorted(kept + new[key], key=lambda x: order.index(x["row"]))

    choices = {r: a for r, a in old.get("choices", {}).items() if r in other}
    choices.update(new["choices"])
    # the fused QK-norm's entries come from their own run (--qknorm)
    kept = {k: v for k, v in old.items() if k.startswith("qknorm")}
    return dict(new, **kept, choices={r: choices[r] for r in order if r in choices},
                scores=merged("scores"), measurements=merged("measurements"),
                runs=earlier + runs(new))


def with_qknorm(old: dict | None, family: str, constants: dict[str, int], run: dict,
                scores: list[dict], measurements: list[dict]) -> dict:
    """The family's table (``old``, or a new one without plan choices) with its fused QK-norm
    entry from a ``--qknorm`` run: ``qknorm`` (the constants), ``qknorm_run`` (command, commit,
    GPU, date, margin, rounds, choices), ``qknorm_scores`` and ``qknorm_measurements``. The run
    decides every constant, so ``old``'s ``qknorm_source`` (constants set by hand from sweeps)
    goes."""
    table = dict(old) if old is not None and old.get("family") == family else dict(
        family=family, choices={}, scores=[], measurements=[], runs=[])
    table.pop("qknorm_source", None)
    return dict(table, qknorm=constants, qknorm_run=run, qknorm_scores=scores,
                qknorm_measurements=measurements)


def score_rows(scores: list[dict]) -> list[list[str]]:
    def cell(x):
        return "-" if x is None else f"{x:.3f}"

    return [[s["row"], s["alternative"], str(s["cases"]), cell(s["geomean"]), cell(s["worst"]),
             "yes" if s["chosen"] else ""] for s in scores]


def main(argv: list[str] | None = None) -> int:
    from tabulate import tabulate

    from ports.fastrope import plan, tuning
    from ports.harness import env

    parser = argparse.ArgumentParser(prog="python -m ports.harness.tune",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="the table's path (default: ports/fastrope/tuned/<family>.json)")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="also write the scores as a results data file")
    parser.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                        help="the rows to tune (default: every row with alternatives)")
    parser.add_argument("--qknorm", action="store_true",
                        help="tune the fused QK-norm's launch constants (the table's qknorm "
                             "entry) instead of the plan's rows, keeping those")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"default {ROUNDS}")
    parser.add_argument("--commit", default=None,
                        help="the commit measured (default: the checkout's)")
    args = parser.parse_args(argv)
    if args.qknorm and args.rows is not None:
        parser.error("--qknorm tunes the fused QK-norm's constants, no plan rows: leave out --rows")
    args.rows = list(TRIALS) if args.rows is None else args.rows
    for row in args.rows:
        if row not in TRIALS:
            parser.error(f"no tunable row {row!r}; choose from {', '.join(map(repr, TRIALS))}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        parser.exit(3, "tuning needs an NVIDIA GPU\n")
    device = torch.cuda.current_device()
    family = tuning.device_family(device)
    out = args.out or tuning.TUNED_DIR / table_name(family)

    def progress(m):
        said = "same plan" if m["same_plan"] else f"{m['us']:.1f} / {m['own_us']:.1f} us"
        print(f"{m['row']} | {m['alternative']} | {m['case']}: {said}", flush=True)

    meta = env.metadata()
    command = "python -m ports.harness.tune" + (" --qknorm" if args.qknorm else "") + (
        f" --rounds {args.rounds}" if args.rounds != ROUNDS else "")
    if args.rows != list(TRIALS):
        command += " --rows " + " ".join(shlex.quote(r) for r in args.rows)
    provenance = dict(command=command, commit=args.commit or meta["git_sha"], gpu=meta["gpu"],
                      driver=env.driver_version(),
                      versions={k: meta[k] for k in ("torch", "triton", "cupy", "python")},
                      date=meta["timestamp"][:10])
    old = json.loads(out.read_text(encoding="utf-8")) if out.exists() else None
    if args.qknorm:
        from ports.harness import qknorm_tune

        measurements = qknorm_tune.measure(args.rounds, REP_MS, progress)
        alternatives = {row: list(alts) for row, alts in qknorm_tune.candidates().items()}
        choices, scores = choose(measurements, list(alternatives), alternatives=alternatives)
        table = with_qknorm(old, family, qknorm_tune.constants_of(choices),
                            dict(provenance, margin=MARGIN, rounds=args.rounds, choices=choices),
                            scores, measurements)
    else:
        measurements = _measure(args.rows, args.rounds, REP_MS, progress)
        choices, scores = choose(measurements, args.rows)
        plan.with_choices(choices)  # every choice names a row and alternative plan.py has
        table = dict(family=family, **provenance, margin=MARGIN, rounds=args.rounds,
                     choices=choices, scores=scores, measurements=measurements)
        if old is not None:
            table = keep_other_rows(old, table, args.rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(f"\n## {family} ({meta['gpu']}): {out}")
    print(tabulate(score_rows(scores), headers=SCORE_COLUMNS, tablefmt="github",
                   disable_numparse=True))
    if args.qknorm:
        print(f"qknorm: {table['qknorm']}")
    if args.json is not None:
        what = ("the fused QK-norm's launch constants against the module's own values, "
                "geometric mean and worst over the qknorm suite's Qwen3-8B shapes"
                if args.qknorm else
                "its row's own, geometric mean and worst over the cases where it changes the plan")
        data = dict(provenance, command=f"{command} --json {shlex.quote(str(args.json))}",
                    section="per-device tuning",
                    context=f"Tuning on {meta['gpu']} ({family}): each alternative's CUDA-graph "
                            f"time over {what} ({args.rounds} rounds).",
                    columns=SCORE_COLUMNS, rows=score_rows(scores))
        args.json.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
