"""The modes of ``compare.py``, one function each: ``MODES[name](args) -> exit status``.

Each takes the parsed and checked arguments (:mod:`ports.harness.cli`). Bad input raises
:class:`UsageError` (one line, exit status 2); a mode that needs a GPU this machine lacks raises
:class:`NeedsGPU` (one line, exit status 3).
"""
from __future__ import annotations

import json
import os
import sys

from ports.harness import preflight

CPU_NOTE = ("No CUDA GPU found: cross-validating what runs on the CPU (the eager references, and "
            "Triton ports under TRITON_INTERPRET=1)\non the given shapes. Timing and the CuPy "
            "ports need an NVIDIA GPU.")
RESULT_KEYS = ("impl", "case", "status")  # every row of a compare.py --json results file


class UsageError(Exception):
    """A bad file, value or name: the message says what was wrong and what would be right."""


class NeedsGPU(Exception):
    """The mode needs an NVIDIA GPU and this machine has none."""


def _torch_ready() -> None:
    """Import torch; without a GPU, set TRITON_INTERPRET before any port defines a kernel."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_user_impls_added = False


def _add_user_impls(args) -> None:
    """Register the --impl functions and the installed rope_ports.impls entry points (once)."""
    global _user_impls_added
    if _user_impls_added:
        return
    from ports import registry

    try:
        registry.add_user_impls(getattr(args, "impl", None) or ())
    except ValueError as exc:  # BadImpl, or a name already taken
        raise UsageError(str(exc)) from None
    _user_impls_added = True


def _specs(args) -> list:
    from ports import registry

    _add_user_impls(args)
    try:
        return registry.select(args.only, args.skip)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None


def _emit(text: str, path: str) -> None:
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}", file=sys.stderr)


def load_rows(path: str, flag: str, keys: tuple[str, ...] = RESULT_KEYS) -> list[dict]:
    """The rows of a ``compare.py --json`` results file, or a UsageError saying what it is not."""
    right = preflight.RESULTS_HINT
    problem = preflight.results_file_problem(flag, path)
    if problem:
        raise UsageError(problem)
    try:
        with open(path) as f:
            rows = json.load(f)
    except OSError as exc:  # e.g. permission denied
        raise UsageError(f"{flag} {path}: cannot read it ({exc.strerror}); {right}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{flag} {path}: not JSON ({str(exc).split(':')[0]}); {right}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UsageError(f"{flag} {path}: not a list of result rows; {right}")
    missing = next((k for r in rows for k in keys if k not in r), None)
    if missing is not None:
        what = " (a --list --json registry?)" if rows and "upstream" in rows[0] else ""
        raise UsageError(f"{flag} {path}: rows have no {missing!r} field{what}; {right}")
    return rows


def _numbers_only(rows: list[dict], field: str, where: str) -> None:
    """A UsageError naming the first row whose ``field`` is neither missing, null nor a number."""
    bad = next((i for i, r in enumerate(rows) if r.get(field) is not None
                and (isinstance(r[field], bool) or not isinstance(r[field], (int, float)))), None)
    if bad is not None:
        raise UsageError(f"{where}: row {bad}'s {field} is {rows[bad][field]!r}, not a number; "
                         f"{preflight.RESULTS_HINT}")


# ---- the modes ---------------------------------------------------------------------------------
def list_mode(args) -> int:
    _torch_ready()
    from ports import registry
    from ports.harness import report

    specs = _specs(args)
    if not args.only and not args.skip:  # the listing names ablations (run only when named)
        specs += [s for s in registry.REGISTRY if s.kind == "ablation"]
    if args.json:
        _emit(report.to_json([report.spec_dict(s) for s in specs]), args.json)
    else:
        print(report.registry_table(specs, verbose=args.verbose))
        missing = report.availability_lines(specs)
        if missing:  # on stderr: stdout stays the table
            print("Peers that cannot run here:\n" + "\n".join(missing), file=sys.stderr)
    return 0


def summary_mode(args) -> int:
    rows = load_rows(args.summary, "--summary")
    if not rows:
        raise UsageError(f"--summary {args.summary}: the file has no results (an empty list); "
                         f"{preflight.RESULTS_HINT}")
    _numbers_only(rows, args.summary_value, f"--summary {args.summary}")
    from ports.harness import report

    has = report.values_with_numbers(rows)
    if args.summary_value not in has:
        cpu = all(str(r.get("gpu", "")).startswith("none") for r in rows)
        why = " (its results were taken without a GPU: no times)" if cpu else ""
        raise UsageError(f"--summary {args.summary}: no row has a {args.summary_value} number"
                         f"{why}; values with numbers: {', '.join(has) or 'none'}")
    print(report.summary_table(rows, args.summary_value))
    return 0


def design_mode(args) -> int:
    _torch_ready()
    from ports.harness import report

    pct = None
    if args.design:
        rows = load_rows(args.design, "--design", keys=("impl",))
        _numbers_only(rows, "pct_copy", f"--design {args.design}")
        pct = report.prefill_pct_copy(rows)
    print(report.design_table(_specs(args), pct, verbose=args.verbose))
    return 0


def overhead_mode(args) -> int:
    _torch_ready()
    from ports.harness import env

    if not env.has_gpu():
        raise NeedsGPU("--overhead times host overhead per GPU launch and needs an NVIDIA GPU")
    from ports.harness import overhead

    print(overhead.table())
    return 0


def claims_mode(args) -> int:
    _torch_ready()
    from ports.harness import claims, env

    if not env.has_gpu():
        print("The claims --claims would measure:\n")
        print(claims.table(claims.unmeasured("needs an NVIDIA GPU: the claims are timings"),
                           env.metadata()["gpu"]))
        raise NeedsGPU("--claims times kernels and needs an NVIDIA GPU")
    print(claims.table(claims.measure(), env.metadata()["gpu"]))
    return 0


def pipeline_mode(args) -> int:
    """Seed 004's RMSNorm + matmul + RoPE experiments: timed on the blog's shapes on a GPU, else
    validated on a tiny shape under the Triton interpreter."""
    _torch_ready()
    from ports.harness import env, pipeline

    experiments = args.pipeline or list(pipeline.EXPERIMENTS)
    if env.has_gpu():
        rows = pipeline.run(None, experiments, seed=args.seed)
    else:
        shape = pipeline.tiny_shapes()[0]
        print(pipeline.NO_GPU_NOTE.format(hidden=shape.hidden) + "\n")
        rows = pipeline.run([shape], experiments, seed=args.seed, device="cpu", timing_on=False)
    print(pipeline.tables(rows))
    return 0 if all(r.status == "ok" for r in rows) else 1


def accuracy_mode(args) -> int:
    _torch_ready()
    from ports.harness import accuracy, env

    specs = _specs(args)
    targets = env.targets()
    max_position = accuracy.MAX_POSITION
    if not env.has_gpu():
        # The Triton interpreter would take hours over 128k positions: references only, and
        # fewer positions (the eager references alone take minutes over 128k on a CPU).
        targets = frozenset({"cpu"})
        max_position = preflight.CPU_MAX_POSITION
        print("No CUDA GPU found: measuring accuracy of what runs on the CPU (the eager "
              f"references)\nat positions up to {max_position:,} (128k on a GPU). The CuPy and "
              "Triton ports need an NVIDIA GPU.\n")
    dtypes = args.dtype if args.dtype != ["fp32"] else ["fp32", "bf16", "fp16"]
    rows = accuracy.measure(specs, dtypes=dtypes, targets=targets, device=env.device(),
                            seed=args.seed, max_position=max_position)
    print(f"## max |out - float64 ideal| by position (b=1, h=1, d=128, positions "
          f"0..{max_position - 1})")
    print(accuracy.table(rows, max_position, verbose=args.verbose))
    if args.plot:
        if not any(r.per_token is not None for r in rows):
            raise UsageError(f"--plot {args.plot}: no implementation ran, so there are no "
                             "errors to plot (compare.py --list says where each runs)")
        accuracy.plot(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def run_mode(args) -> int:
    """Validate (and on a GPU time) the implementations on the --shape and --suite cases."""
    if not args.shape and not args.suite:
        if args.only or args.skip:  # a misspelt name is the first thing to fix
            _torch_ready()
            _specs(args)
        raise UsageError("nothing to run: give --shape or --suite (or --list)")
    _torch_ready()
    from tqdm import tqdm

    from ports.harness import env, report
    from ports.harness.cases import cases_from_args
    from ports.harness.runner import run_case
    from ports.harness.suites import GRAPH_SUITES

    specs = _specs(args)
    if args.plot and not env.has_gpu():
        raise NeedsGPU(f"--plot {args.plot} draws GB/s, which needs timings (an NVIDIA GPU); "
                       "this machine has none (--accuracy --plot runs on the CPU)")
    try:
        cases = cases_from_args(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not env.has_gpu():
        too_big = preflight.over_cpu_cap(cases)
        if len(too_big) == len(cases):
            raise UsageError(preflight.cpu_refusal(too_big))
        if too_big:
            print(preflight.cpu_skip_note(too_big), file=sys.stderr)
            cases = [c for c in cases if c not in too_big]

    graph = args.graph or any(name in GRAPH_SUITES for name in args.suite or ())
    quiet = args.json == "-" or args.csv == "-"
    if not env.has_gpu() and not quiet:
        print(CPU_NOTE + "\n")
    reports, failed = [], False
    bar = tqdm(total=len(cases) * len(specs), disable=True if args.no_progress else None,
               unit="run", file=sys.stderr, leave=False)
    try:
        for case in cases:
            rep = run_case(case, specs, seed=args.seed, graph=graph, progress=bar)
            reports.append(rep)
            if not quiet:
                tqdm.write(report.case_table(rep, graph=graph, verbose=args.verbose) + "\n",
                           file=sys.stdout)
            if rep.failed:
                failed = True
                if not args.keep_going:
                    tqdm.write("stopping after a failed case (use --keep-going to run the rest)",
                               file=sys.stderr)
                    break
    finally:
        bar.close()
    if args.plot:
        if report.has_times(reports):
            report.plot_bandwidth(reports, args.plot)
            print(f"wrote {args.plot}", file=sys.stderr)
        else:
            print(f"--plot {args.plot}: no implementation was timed, so there are no times to "
                  "plot; nothing written", file=sys.stderr)
            failed = True
    if args.json or args.csv:
        rows = report.flat_rows(reports, env.metadata())
        if args.json:
            _emit(report.to_json(rows), args.json)
        if args.csv:
            _emit(report.to_csv(rows), args.csv)
    return 1 if failed else 0


MODES = {"list": list_mode, "summary": summary_mode, "design": design_mode,
         "overhead": overhead_mode, "claims": claims_mode, "accuracy": accuracy_mode,
         "pipeline": pipeline_mode, "run": run_mode}
