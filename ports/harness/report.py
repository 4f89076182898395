"""Tables (tabulate), CSV and JSON from study results. Every cell is a number or a reason."""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence

import tabulate

from ports._spec import ImplSpec
from ports.harness.metrics import SUMMARY_VALUES, gbps
from ports.harness.result import CaseReport, Result

RESULT_HEADERS = ("implementation", "check", "max abs err", "max rel err", "err/tol",
                  "median us", "GB/s", "% copy", "vs eager", "÷ compile")
# The default (compact) table: the rows that ran, without the relative error and GB/s (% copy
# says the same); --verbose shows every row and column.
COMPACT_DROP = ("max rel err", "GB/s")
TIME_HEADERS = ("median us", "graph us", "GB/s", "% copy", "vs eager", "÷ compile",
                "graph ÷ compile")
WIDTH = 140  # the default output fits a terminal this wide
HOST_BOUND_MARK = "*"
HOST_BOUND_NOTE = (f"{HOST_BOUND_MARK} host-bound event time: over twice the CUDA-graph replay, "
                   "or (tiny case) over twice the same-size copy; the kernel's own time is lower")
# --summary-value formats; the rest take .1f
SUMMARY_FORMATS = {"pct_copy": ".0f", "pct_size_copy": ".0f", "vs_compile": ".2f",
                   "graph_vs_compile": ".2f", "vs_fastest": ".2f", "graph_vs_fastest": ".2f"}
SUMMARY_TITLES = {"vs_fastest": "time / the case's fastest time (1.00 = fastest)",
                  "graph_pct_size_copy": "% of the speed of a same-size copy, both replayed "
                                         "from CUDA graphs",
                  "graph_vs_fastest": "CUDA-graph time / the case's fastest graph time "
                                      "(1.00 = fastest)"}


def note_lines(pairs: Iterable[tuple[str, str]]) -> list[str]:
    """``note: impl: text`` lines for (implementation, note) pairs with a note, once each: the
    equal-inputs departures (work a peer's adapter does outside the timed call)."""
    notes = dict.fromkeys((impl, note) for impl, note in pairs if note)
    return [_wrapped(f"note: {impl} is given less work: {note}") for impl, note in notes]


def row_note_lines(results: Iterable[Result]) -> list[str]:
    """``impl: text`` for what the checks found about a row that passed: its CUDA-graph capture
    failed (``no CUDA-graph time: why``; its graph cell reads ``failed``), or its backward wrote
    into its incoming gradient."""
    return [_wrapped(f"{r.impl}: {text}") for r in results
            for text in (r.graph_note, r.gradient_note) if text]


def text_table(rows: Sequence[Sequence[str]], headers: Sequence[str], fmt: str = "github",
               fit: bool = False) -> str:
    """A table of text cells, without tabulate's two spaces of header padding; with ``fit``, the
    widest columns wrap between words (over several lines per row) until the table fits
    :data:`WIDTH`, or until every column is as narrow as its longest word."""
    kw = {}
    if fit and rows:
        columns = list(zip(headers, *rows))
        limits = [max(len(line) for c in column for line in str(c).splitlines() or [""])
                  for column in columns]
        floors = [max(len(w) for c in column for w in str(c).split() or [""])
                  for column in columns]
        while sum(limits) + 3 * len(limits) + 1 > WIDTH:
            narrowable = [i for i in range(len(limits)) if limits[i] > floors[i]]
            if not narrowable:
                break
            limits[max(narrowable, key=limits.__getitem__)] -= 1
        kw = {"maxcolwidths": limits, "maxheadercolwidths": limits}
    saved, tabulate.MIN_PADDING = tabulate.MIN_PADDING, 0
    try:
        return tabulate.tabulate(rows, headers=list(headers), tablefmt=fmt,
                                 disable_numparse=True, **kw)
    finally:
        tabulate.MIN_PADDING = saved


def _num(value: float | None, fmt: str, missing: str) -> str:
    return missing if value is None else format(value, fmt)


def result_row(r: Result, graph: bool = False) -> list[str]:
    """One full (--verbose) row. Cells without a number carry the short reason (the check cell
    the long one)."""
    if r.status in ("unsupported", "error", "OOM"):
        cells = [r.status] * (len(RESULT_HEADERS) - 2 + (2 if graph else 0))
        return [r.impl, f"{r.status}: {r.reason}", *cells]
    check = "ok" if r.status == "ok" else f"FAIL: {r.reason}"
    no_time = "failed" if r.status != "ok" else ("no GPU" if r.timing_note else "n/a")
    # a timed row without a ratio lacks the other row's time; an untimed one says why it has none
    ratio_missing = "n/a" if r.median_us is not None else no_time
    median = _num(r.median_us, ".1f", no_time) + (HOST_BOUND_MARK if r.host_bound else "")
    row = [
        r.impl, check,
        _num(r.max_abs_err, ".2e", "n/a"),
        _num(r.max_rel_err, ".2e", "n/a"),
        _num(r.err_over_tol, ".2f", "n/a"),
        median,
    ]
    if graph:
        row.append(_num(r.graph_us, ".1f", "failed" if r.graph_note else no_time))
    row += [
        _num(r.gbps, ".0f", no_time),
        _num(r.pct_copy, ".1f", no_time),
        _num(r.speedup, ".2f", ratio_missing),
        _num(r.vs_compile, ".2f", ratio_missing),
    ]
    if graph:
        row.append(_num(r.graph_vs_compile, ".2f", ratio_missing))
    return row


def result_headers(graph: bool = False) -> list[str]:
    headers = list(RESULT_HEADERS)
    if graph:
        headers.insert(6, "graph us")
        headers.append("graph ÷ compile")
    return headers


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _wrapped(text: str, indent: str = "  ") -> str:
    import textwrap

    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False)


def unsupported_line(results: Sequence[Result]) -> str:
    """The implementations that do not support the case, grouped by reason, in one (wrapped)
    line: ``unsupported: apex.* (layout ...); torch.llama_real, ... (...)``. A name prefix all
    of whose rows share a reason is written ``prefix.*``."""
    skipped = [r for r in results if r.status == "unsupported"]
    if not skipped:
        return ""
    by_reason: dict[str, list[str]] = {}
    for r in skipped:
        by_reason.setdefault(r.reason, []).append(r.impl)
    prefix_count: dict[str, int] = {}
    for r in results:
        prefix_count[r.impl.split(".")[0]] = prefix_count.get(r.impl.split(".")[0], 0) + 1
    groups = []
    for reason, names in by_reason.items():
        shown: list[str] = []
        for name in names:
            prefix = name.split(".")[0]
            whole = "." in name and sum(n.split(".")[0] == prefix for n in names) == \
                prefix_count[prefix] > 1
            label = f"{prefix}.*" if whole else name
            if label not in shown:
                shown.append(label)
        groups.append(f"{', '.join(shown)} ({reason})")
    return _wrapped(f"unsupported: {'; '.join(groups)}")


def _compact(report: CaseReport, graph: bool) -> tuple[list[str], list[list[str]], list[str]]:
    """Headers, rows and footer lines of the default table: the rows that ran; columns without
    a number in any row are left out with the reason in the footer; failures' reasons below."""
    ran = [r for r in report.results if r.status != "unsupported"]
    headers = result_headers(graph)
    rows = [result_row(r, graph) for r in ran]
    footer = []
    for r in ran:
        if r.status != "ok":
            footer.append(_wrapped(f"{r.impl}: {r.status}: {r.reason}"))
    for row, r in zip(rows, ran):
        if r.status != "ok":
            row[1] = r.status
    drop = set(COMPACT_DROP)
    if not any(r.median_us is not None for r in ran):
        drop.update(TIME_HEADERS)
        note = next((r.timing_note for r in ran if r.status == "ok" and r.timing_note),
                    "no implementation passed")
        footer.append(f"no times: {note.replace('not timed: ', '')}")
    keep = [i for i, h in enumerate(headers) if h not in drop]
    if any(r.host_bound for r in ran):
        footer.append(HOST_BOUND_NOTE)
    footer += note_lines((r.impl, r.note) for r in ran)
    footer += row_note_lines(ran)
    return ([headers[i] for i in keep], [[row[i] for i in keep] for row in rows], footer)


def case_table(report: CaseReport, graph: bool = False, verbose: bool = False,
               fmt: str = "github") -> str:
    """A titled table for one case; the title states the units and the byte count.

    By default the rows that ran, with the unsupported implementations in one line below;
    ``verbose``: a full row for every implementation."""
    case = report.case
    title = f"## {case.label + ': ' if case.label else ''}{case.describe()}"
    same, replayed = report.copy_same_us, report.copy_same_graph_us
    same_gbps = gbps(case.io_bytes(), same)
    lines = [title,
             f"bytes moved {_bytes(case.io_bytes())} (rotated tensors, read + write)"
             + (f"; copy {report.copy_gbps:.0f} GB/s" if report.copy_gbps else "")
             + (f"; same-size copy {same:.1f} us ({same_gbps:.0f} GB/s)" if same else "")
             + (f", replayed {replayed:.1f} us" if same and replayed else "")
             + (f"; vs eager: {report.baseline}" if report.baseline else "; no eager baseline")]
    if verbose:
        rows = [result_row(r, graph) for r in report.results]
        lines.append(text_table(rows, result_headers(graph), fmt))
        if any(r.host_bound for r in report.results):
            lines.append(HOST_BOUND_NOTE)
        lines += note_lines((r.impl, r.note) for r in report.results)
        lines += row_note_lines(report.results)
        return "\n".join(lines)
    headers, rows, footer = _compact(report, graph)
    if rows:
        lines.append(text_table(rows, headers, fmt, fit=True))
    else:
        lines.append("no implementation supports this case")
    lines += footer
    skipped = unsupported_line(report.results)
    if skipped:
        lines.append(skipped)
    return "\n".join(lines)


def flat_rows(reports: Iterable[CaseReport], meta: dict[str, str]) -> list[dict]:
    """One flat dict per (case, implementation), with provenance, for CSV and JSON."""
    rows = []
    for rep in reports:
        case_fields = {f"case_{k}": v for k, v in rep.case.__dict__.items()}
        case_fields["case_seqlens"] = (None if rep.case.seqlens is None
                                       else "/".join(map(str, rep.case.seqlens)))
        for r in rep.results:
            rows.append({**meta, **case_fields, "case": rep.case.describe(),
                         "io_bytes": rep.case.io_bytes(), "copy_gbps": rep.copy_gbps,
                         "copy_same_us": rep.copy_same_us,
                         "copy_same_graph_us": rep.copy_same_graph_us, "baseline": rep.baseline,
                         **r.as_dict()})
    return rows


def to_json(rows: Sequence[dict]) -> str:
    return json.dumps(rows, indent=1, default=str)


def to_csv(rows: Sequence[dict]) -> str:
    if not rows:
        return ""
    buf = io.StringIO()
    fields = list(dict.fromkeys(k for row in rows for k in row))
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


# ---- the registry listing --------------------------------------------------------------------
def spec_dict(spec: ImplSpec) -> dict:
    return {
        "name": spec.name,
        "family": spec.family,
        "backend": spec.backend,
        "kind": spec.kind,
        "styles": sorted(spec.styles),
        "layouts": sorted(spec.layouts),
        "dtypes": sorted(spec.dtypes),
        "partial": spec.partial,
        "positions": sorted(spec.positions),
        "backward": spec.backward,
        "tensors_per_launch": spec.tensors_per_launch,
        "strided": spec.strided,
        "index_bits": spec.index_bits,
        "table_source": spec.table_source,
        "devices": sorted(spec.devices),
        "summary": spec.summary,
        "upstream": spec.upstream,
        "caller_work": getattr(spec, "caller_work", ""),
        "given_less_work": getattr(spec, "given_less_work", ""),
    }


def availability_lines(specs: Sequence[ImplSpec]) -> list[str]:
    """One line per peer whose library cannot be imported here: ``name: not installed: ...``."""
    lines = []
    for spec in specs:
        missing = getattr(spec, "missing", None)
        reason = missing() if missing is not None else None
        if reason:
            lines.append(_wrapped(f"{spec.name}: {reason}"))
    return lines


def registry_table(specs: Sequence[ImplSpec], verbose: bool = False, fmt: str = "github") -> str:
    """One row per spec, fit to :data:`WIDTH` ("all" for a full set; the tensors per launch,
    index bits, cos/sin source and upstream are in --verbose, JSON and --design); ``verbose``:
    every column, one line per row."""
    from reference.vocabulary import LAYOUTS, POSITION_KINDS, STYLES

    def words(values, every=()):
        return "all" if set(values) == set(every) else " ".join(values)

    headers = ["name", "family", "backend", "styles", "layouts", "dtypes", "partial",
               "positions", "bwd", "tensors/launch", "index", "cos/sin from", "upstream"]
    rows = []
    for s in specs:
        d = spec_dict(s)
        rows.append([
            d["name"], d["family"], d["backend"], words(d["styles"], STYLES if not verbose else ()),
            words(d["layouts"], LAYOUTS if not verbose else ()), " ".join(d["dtypes"]),
            "yes" if d["partial"] else "no",
            words(d["positions"], POSITION_KINDS if not verbose else ()),
            "yes" if d["backward"] else "no",
            str(d["tensors_per_launch"]) if d["tensors_per_launch"] else "eager ops",
            f"int{d['index_bits']}", d["table_source"], d["upstream"],
        ])
    if not verbose:
        left_out = ("tensors/launch", "index", "cos/sin from", "upstream")
        keep = [i for i, h in enumerate(headers) if h not in left_out]
        headers, rows = [headers[i] for i in keep], [[row[i] for i in keep] for row in rows]
    return text_table(rows, headers, fmt, fit=not verbose)


def has_times(reports: Sequence[CaseReport]) -> bool:
    """Whether any result of ``reports`` was timed (what :func:`plot_bandwidth` draws)."""
    return any(r.gbps is not None for rep in reports for r in rep.results)


def plot_bandwidth(reports: Sequence[CaseReport], path: str) -> None:
    """GB/s against tokens, one line per implementation (one style in every panel), one panel
    per (layout, dtype, direction, style), with the measured copy bandwidth as the roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ports.harness import plotstyle

    panels: dict[tuple, list[CaseReport]] = {}
    for rep in reports:
        c = rep.case
        panels.setdefault((c.layout, c.dtype, c.direction, c.style), []).append(rep)
    style = plotstyle.styles(r.impl for rep in reports for r in rep.results
                             if r.gbps is not None)
    roofline = {"color": "black", "linestyle": "--", "marker": ""}
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (key, reps) in zip(axes[0], panels.items()):
        lines: dict[str, list[tuple[float, float]]] = {}
        for rep in reps:
            for r in rep.results:
                if r.gbps is not None:
                    lines.setdefault(r.impl, []).append((rep.case.tokens, r.gbps))
        for impl, points in lines.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], markersize=3, linewidth=1,
                    **style[impl])
        copies = [rep.copy_gbps for rep in reps if rep.copy_gbps]
        if copies:
            ax.axhline(max(copies), linewidth=1, **roofline)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (b x s)")
        ax.set_ylabel("GB/s (read + write of rotated tensors)")
        ax.set_title(" ".join(key))
        ax.grid(True, alpha=0.3)
    plotstyle.figure_legend(fig, [*style.items(), ("copy bandwidth (roofline)", roofline)])
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def design_table(specs: Sequence[ImplSpec], pct_copy: dict[str, float] | None = None,
                 verbose: bool = False, fmt: str = "github") -> str:
    """Design notes per implementation, from the registry (so they cannot drift from the code),
    with the median % of copy bandwidth over the prefill suite where results are given; wrapped
    to fit :data:`WIDTH` unless ``verbose`` (one line per row)."""
    headers = ["implementation", "launch", "work per thread", "loads/stores", "math, cos/sin",
               "index", "prefill % copy"]
    rows = []
    for s in specs:
        pct = (pct_copy or {}).get(s.name)
        rows.append([s.name, s.launch or "-", s.per_thread or "-", s.access or "-",
                     s.math or s.table_source, f"int{s.index_bits}",
                     "not measured" if pct is None else f"{pct:.0f}"])
    return text_table(rows, headers, fmt, fit=not verbose)


def prefill_pct_copy(rows: Sequence[dict]) -> dict[str, float]:
    """Median % of copy bandwidth per implementation over result rows (e.g. a prefill JSON)."""
    import statistics

    by_impl: dict[str, list[float]] = {}
    for r in rows:
        if r.get("pct_copy") is not None:
            by_impl.setdefault(r["impl"], []).append(float(r["pct_copy"]))
    return {k: statistics.median(v) for k, v in by_impl.items()}


def values_with_numbers(rows: Sequence[dict]) -> list[str]:
    """The --summary-value choices that have a number in at least one row."""
    return [v for v in SUMMARY_VALUES if any(r.get(v) is not None for r in rows)]


def _column_groups(rows: Sequence[Sequence[str]], headers: Sequence[str], fmt: str) -> str:
    """A wide table as several, each of the first column and as many of the others as fit in
    :data:`WIDTH` (a name's family on its own header line: ``torch.`` over ``hf_rotate_half``)."""
    headers = [headers[0], *(h.replace(".", ".\n", 1) for h in headers[1:])]

    def width(i: int) -> int:
        return max([len(line) for line in headers[i].splitlines()]
                   + [len(str(row[i])) for row in rows]) + 3

    groups: list[list[int]] = []
    used = width(0) + 1
    for i in range(1, len(headers)):
        if not groups or used + width(i) > WIDTH:
            groups.append([])
            used = width(0) + 1
        groups[-1].append(i)
        used += width(i)
    return "\n\n".join(
        text_table([[row[0], *(row[i] for i in group)] for row in rows],
                   [headers[0], *(headers[i] for i in group)], fmt, fit=True)
        for group in groups or [[]])


def summary_table(rows: Sequence[dict], value: str = "pct_copy", fmt: str = "github") -> str:
    """Cases (rows) against implementations (columns) from a results file: one number per cell
    (``value``, e.g. ``pct_copy``, ``median_us`` or ``vs_compile``), or the short status where
    there is none. Implementations that ran on no case are left out."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cell = {(r["impl"], r["case"]): r for r in rows}
    impls = [i for i in dict.fromkeys(r["impl"] for r in rows)
             if any(cell.get((i, c), {}).get(value) is not None for c in cases)]
    body = []
    for case in cases:
        line = [case.replace(" rotate_half", "").replace(" cos/sin same", "")]
        for impl in impls:
            r = cell.get((impl, case))
            if r is None:
                line.append("")
            elif r.get(value) is not None:
                v = float(r[value])
                line.append(format(v, SUMMARY_FORMATS.get(value, ".1f")))
            else:
                line.append({"unsupported": "-"}.get(r["status"], r["status"]))
        body.append(line)
    lines = [f"{value}: {SUMMARY_TITLES[value]}"] if value in SUMMARY_TITLES else []
    lines.append(_column_groups(body, ["case", *impls], fmt))
    lines += note_lines((r["impl"], r.get("note", "")) for r in rows if r["impl"] in impls)
    return "\n".join(lines)
