"""``compare.py --overhead`` (a benchmark, not a test): host time per call on a tiny input.
Needs an NVIDIA GPU.

Rows: a port's adapter next to a bare CuPy RawKernel launch of the same kernel; fastrope's direct
calls, its registered ops through the dispatcher, and compiled calls (``fullgraph``, no CUDA
graphs) next to a compiled ``t.add_(0)``. Under the table, the ratios fastrope's host cost is
judged by: the op through the dispatcher over the direct call, and a compiled call minus the
compiled trivial op.

Each call is timed alone (``time.perf_counter_ns`` around it; the GPU work is tiny, so the host,
not the GPU, sets the pace: the GPU time of one launch is printed too). Work elsewhere on the
host adds time to some calls and never removes any, so each row gives two statistics of its
calls: the median (what a typical call paid) and the 10th percentile (the call's own cost with
little of that added), which moves much less between runs than the mean of a block of calls
(results/README.md, "fastrope's host cost, call by call").

    python -m ports.harness.overhead --json results/data/NAME.json --commit SHA

writes the table as a results data file (tools/results_tables.py renders it).
"""
from __future__ import annotations

import functools
import time

import torch

CALLS = 1000
ROUNDS = 21
"""Each row is timed in ``ROUNDS`` rounds of ``CALLS`` calls, the rows interleaved round by round
(so drift on the host spreads over all of them); a row's statistics are over all its calls."""
LOW_PERCENTILE = 10


def _call_times_us(fn, calls: int = CALLS) -> list[float]:
    """The time of each of ``calls`` calls of ``fn``, alone, after warm-up."""
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    clock = time.perf_counter_ns
    times = []
    for _ in range(calls):
        start = clock()
        fn()
        times.append((clock() - start) / 1e3)
    torch.cuda.synchronize()
    return times


def _rows() -> dict:
    """What is timed: label -> a zero-argument call."""
    import numpy as np

    from ports import _cupy, leetcuda

    cp = _cupy.cupy()
    x = torch.randn(4, 64, device="cuda")
    out = torch.empty_like(x)
    rows = {"adapter: leetcuda.rope_f32(x, out)": lambda: leetcuda.rope_f32(x, out)}

    raw = cp.RawKernel(leetcuda.MODULE.source, "rope_f32_kernel", options=("--use_fast_math",))
    xc = cp.random.standard_normal((4, 64), dtype=cp.float32)
    oc = cp.empty_like(xc)
    args = (xc, oc, np.int32(4), np.int32(32))
    rows["bare cupy.RawKernel launch"] = lambda: raw((1,), (256,), args)

    fn = leetcuda.MODULE.function("rope_f32_kernel", x.get_device())
    stream = _cupy._external_stream(_cupy._current_raw_stream(x.get_device()), x.get_device())
    pargs = (_cupy.ptr(x), _cupy.ptr(out), np.int32(4), np.int32(32))
    rows["cached Function, torch stream, no checks"] = lambda: fn((1,), (256,), pargs,
                                                                  stream=stream)

    from ports import fastrope

    q = torch.randn(1, 1, 4, 64, device="cuda")
    cos, sin = torch.randn(16, 64, device="cuda"), torch.randn(16, 64, device="cuda")
    k = torch.randn(1, 1, 2, 64, device="cuda")
    rows[DIRECT] = lambda: fastrope.apply_rope_inplace(q, cos=cos, sin=sin)
    rows["fastrope.apply_rope(q, cos=, sin=) (allocates its output)"] = \
        lambda: fastrope.apply_rope(q, cos=cos, sin=sin)
    rows["(torch.empty_like(q) alone)"] = lambda: torch.empty_like(q)
    rows["fastrope.apply_rope_inplace(q, k, computed angles)"] = \
        lambda: fastrope.apply_rope_inplace(q, k)

    # The registered ops through the dispatcher, and the per-call cost under torch.compile.
    op_args = (None, cos, sin, None, None, 0, None, None, "rotate_half", "bshd", None, 10000.0,
               None, True)
    rows[OP] = lambda: torch.ops.fastrope.rope_(q, *op_args)
    rows["torch.ops.fastrope.rope(q, ...) (the op, eager dispatch; allocates)"] = \
        lambda: torch.ops.fastrope.rope(q, *op_args, False)
    probe = _probe_ops(_cached_launch(q, cos, sin))
    compiled = {
        COMPILED_INPLACE: lambda t: fastrope.apply_rope_inplace(t, cos=cos, sin=sin),
        COMPILED: lambda t: fastrope.apply_rope(t, cos=cos, sin=sin),
        COMPILED_ADD: lambda t: t.add_(0),
        COMPILED_ADD_OUT: lambda t: t + 0,
        COMPILED_NOOP: lambda t: probe.noop_(t, *op_args),
        COMPILED_LAUNCH: lambda t: probe.launch_(t, *op_args),
    }
    for label, f in compiled.items():
        rows[label] = functools.partial(torch.compile(f, fullgraph=True), q)
    return rows


def _cached_launch(q, cos, sin):
    """fastrope's own launch of ``apply_rope_inplace(q, cos=cos, sin=sin)``, as its cache holds
    it after one call: the pointers packed and ``cuLaunchKernel``, with no checks and no lookup."""
    from ports import fastrope
    from ports.fastrope import launcher, problem, run

    fastrope.apply_rope_inplace(q, cos=cos, sin=sin)
    key = problem.input_key(q=q, k=None, cos=cos, sin=sin, positions=None, offsets=None,
                            cu_seqlens=None, max_seqlen=None, style="rotate_half", layout="bshd",
                            rotary_dim=None, base=10000.0, inv_freq=None, extra=(True, False))
    ((lc, _),) = run.DESIGN.entries[key].launches
    ptrs = (q.data_ptr(), 0, q.data_ptr(), 0, cos.data_ptr(), sin.data_ptr(), 0, 0, 0, 0)
    return lambda: launcher.launch(lc, *ptrs)


_PROBE = "rope_overhead_probe"
_probe_launch = []  # the launch the probe op makes (set by _probe_ops)


def _probe_ops(launch):
    """Two ops with rope_'s schema, declared as fastrope's are (torch.library.Library, one Python
    kernel): ``noop_`` does nothing, ``launch_`` only ``launch()``: fastrope's cached launch with
    no checks. Compiled, they give the floor of a Python op that launches fastrope's kernel."""
    _probe_launch[:] = [launch]
    if not hasattr(torch.ops, _PROBE) or not hasattr(getattr(torch.ops, _PROBE), "noop_"):
        lib = torch.library.Library(_PROBE, "DEF")
        _probe_ops.lib = lib  # the registrations live as long as the library object
        schema = torch.ops.fastrope.rope_.default._schema
        args = str(schema)[str(schema).index("("):]
        for name, impl in (("noop_", lambda *a: None),
                           ("launch_", lambda *a: _probe_launch[0]())):
            lib.define(name + args)
            lib.impl(name, impl, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{_PROBE}::{name}", lambda *a: None, lib=lib)
    return getattr(torch.ops, _PROBE)


DIRECT = "fastrope.apply_rope_inplace(q, cos=, sin=)"
OP = "torch.ops.fastrope.rope_(q, ...) (the op, eager dispatch)"
COMPILED_INPLACE = "compiled fastrope.apply_rope_inplace(q, cos=, sin=) (fullgraph)"
COMPILED = "compiled fastrope.apply_rope(q, cos=, sin=) (fullgraph)"
COMPILED_ADD = "(compiled t.add_(0) alone: a compiled call's own cost)"
COMPILED_ADD_OUT = "(compiled t + 0 alone: the same, allocating its output)"
COMPILED_NOOP = "(compiled op with rope_'s schema doing nothing: the op boundary)"
COMPILED_LAUNCH = "(compiled op with rope_'s schema, only fastrope's cached launch: the floor)"


def measure(rounds: int = ROUNDS) -> dict[str, list[list[float]]]:
    """label -> each round's call times (us)."""
    rows = _rows()
    times: dict[str, list[list[float]]] = {label: [] for label in rows}
    for _ in range(rounds):
        for label, fn in rows.items():
            times[label].append(_call_times_us(fn))
    return times


def statistics_of(rounds: list[list[float]]) -> dict[str, float]:
    """A row's statistics over all its calls: ``median``, ``low`` (the ``LOW_PERCENTILE``th
    percentile), and the lowest and highest of the rounds' medians (how far the host drifted)."""
    import numpy as np

    calls = np.concatenate([np.asarray(r, dtype=float) for r in rounds])
    medians = [float(np.median(r)) for r in rounds]
    return {"median": float(np.median(calls)),
            "low": float(np.percentile(calls, LOW_PERCENTILE)),
            "rounds_min": min(medians), "rounds_max": max(medians)}


def ratios(stats: dict[str, dict[str, float]]) -> list[tuple[str, str, str]]:
    """The host-cost ratios fastrope is judged by, at the median and at the low percentile: the
    eager op against the direct call, and a compiled call over a compiled trivial op (in place
    against ``t.add_(0)``, allocating against ``t + 0``)."""
    def minus(a: str, b: str, at: str) -> str:
        return f"{stats[a][at] - stats[b][at]:+.1f} us"

    rows = [("the op through the dispatcher / the direct call",
             *(f"{stats[OP][at] / stats[DIRECT][at]:.2f}x" for at in ("median", "low")))]
    for what, a, b in (
            ("compiled apply_rope_inplace - compiled t.add_(0)", COMPILED_INPLACE, COMPILED_ADD),
            ("compiled apply_rope - compiled t + 0", COMPILED, COMPILED_ADD_OUT),
            ("floor: compiled launch-only op - compiled t.add_(0)", COMPILED_LAUNCH,
             COMPILED_ADD)):
        rows.append((what, minus(a, b, "median"), minus(a, b, "low")))
    return rows


def _measured() -> tuple[str, list[list[str]]]:
    """(title, rows of [what, median us, low-percentile us, rounds' medians], then the
    ratios)."""
    from ports.harness.timing import median_us

    stats = {label: statistics_of(rounds) for label, rounds in measure().items()}
    rows = [[label, f"{s['median']:.1f}", f"{s['low']:.1f}",
             f"{s['rounds_min']:.1f}-{s['rounds_max']:.1f}"] for label, s in stats.items()]
    rows += [[what, median, low, ""] for what, median, low in ratios(stats)]
    from ports import leetcuda

    x = torch.randn(4, 64, device="cuda")
    out = torch.empty_like(x)
    rows.append(["(GPU time of one leetcuda launch)",
                 f"{median_us(lambda: leetcuda.rope_f32(x, out)):.1f}", "", ""])
    from ports.fastrope import replay

    kernels = ("C++ (replay.cpp)" if replay.loaded()
               else f"Python ({replay.reason})")
    title = (f"host time per call, tiny input (q[1, 1, 4, 64] fp32), "
             f"{torch.cuda.get_device_name()}: {ROUNDS} interleaved rounds of {CALLS} calls, each "
             f"timed alone; the mutating ops' kernels: {kernels}")
    return title, rows


COLUMNS = ["what", "median us", f"p{LOW_PERCENTILE} us", "rounds' medians"]


def table() -> str:
    """The measured host times as a titled table."""
    title, rows = _measured()
    return table_from({"context": title, "columns": COLUMNS, "rows": rows})


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from ports.harness import env

    parser = argparse.ArgumentParser(prog="python -m ports.harness.overhead",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the table as a results data file")
    parser.add_argument("--commit", default=None,
                        help="the commit measured (default: the checkout's)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(3, "the host-overhead benchmark needs an NVIDIA GPU\n")
    title, rows = _measured()
    meta = env.metadata()
    data = {"command": "python -m ports.harness.overhead --json " + args.json,
            "commit": args.commit or meta["git_sha"], "gpu": meta["gpu"],
            "driver": env.driver_version(),
            "versions": {k: meta[k] for k in ("torch", "triton", "cupy", "python")},
            "date": meta["timestamp"][:10], "section": "host cost", "context": title,
            "columns": COLUMNS, "rows": rows}
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(table_from(data))
    return 0


def table_from(data: dict) -> str:
    from tabulate import tabulate

    return f"## {data['context']}\n" + tabulate(data["rows"], headers=data["columns"],
                                                tablefmt="github", disable_numparse=True)


if __name__ == "__main__":
    raise SystemExit(main())
