"""Accuracy by position: each implementation's max error against the *ideal* float64 RoPE,
bucketed by token position up to 128k.

Unlike validation (which compares each design with the oracle of the inputs it consumed), this
measures what a user gets: a table rounded to fp32 or to x's dtype, fp32 angles, half-precision
angles and fast-math sin/cos all show up here as error growing with position.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ports import _alloc
from ports._spec import ImplSpec
from reference.case import RopeCase, make_inputs
from reference.expected import expected

BUCKETS = (0, 1024, 4096, 16384, 32768, 65536, 131072)
MAX_POSITION = BUCKETS[-1]


@dataclass
class AccuracyRow:
    impl: str
    dtype: str
    source: str           # where its cos/sin come from
    bucket_errors: list   # max abs error per bucket (None: not run) or a reason string
    table_dtype: str = "fp32"  # the cos_sin_dtype it was given ("same": x's dtype)
    per_token: torch.Tensor | None = None  # max abs error per position (for plots)


def buckets(max_position: int = MAX_POSITION) -> tuple[int, ...]:
    """The bucket edges up to ``max_position`` (which ends the last bucket)."""
    return tuple(b for b in BUCKETS if b < max_position) + (max_position,)


def bucket_labels(max_position: int = MAX_POSITION) -> list[str]:
    def k(n):
        return f"{n // 1024}k" if n >= 1024 else str(n)
    edges = buckets(max_position)
    return [f"[{k(a)}, {k(b)})" for a, b in zip(edges[:-1], edges[1:])]


def _source_label(spec: ImplSpec, case: RopeCase) -> str:
    if spec.table_source == "tables":
        return f"table given ({str(case.table_dtype).replace('torch.', '')})"
    if spec.table_source == "angles32":
        return "angles given (fp32)"
    if spec.angle_err(case) > 1e-4:
        return "computed (angle in x's dtype)"
    return "computed in kernel" if spec.backend != "torch" else "computed (fp32 table)"


def measure(specs: Sequence[ImplSpec], *, dtypes: Sequence[str] = ("fp32", "bf16", "fp16"),
            targets, device, head_dim: int = 128, seed: int = 0,
            max_position: int = MAX_POSITION) -> list[AccuracyRow]:
    """One row per (implementation, dtype, table dtype it was given)."""
    rows: list[AccuracyRow] = []
    for spec in specs:
        for dtype in dtypes:
            table_dtypes = ("fp32",) if dtype == "fp32" else ("fp32", "same")
            if spec.table_source != "tables":
                table_dtypes = ("fp32",)
            for table_dtype in table_dtypes:
                rows.append(_one(spec, dtype, table_dtype, targets, device, head_dim, seed,
                                 max_position))
    return rows


def _one(spec, dtype, table_dtype, targets, device, head_dim, seed,
         max_position) -> AccuracyRow:
    style = "rotate_half" if "rotate_half" in spec.styles else "interleaved"
    case = RopeCase(1, max_position, 1, head_dim, dtype=dtype, style=style,
                    cos_sin_dtype=table_dtype, label="accuracy")
    reason = spec.unsupported_reason(case, targets)
    source = _source_label(spec, case)
    if reason is not None:
        return AccuracyRow(spec.name, dtype, source, [f"unsupported: {reason}"], table_dtype)
    try:
        inputs = make_inputs(case, seed, device)
        with _alloc.poisoned():
            (out,) = spec.prepare(case, inputs)()
        (ideal,) = expected(case, inputs, "computed")
        err = (out.to(torch.float64) - ideal).abs().reshape(max_position, -1).amax(dim=1)
    except Exception as exc:  # one implementation must not stop the others
        return AccuracyRow(spec.name, dtype, source,
                           [f"error: {type(exc).__name__}: {exc}"[:120]], table_dtype)
    edges = buckets(max_position)
    maxima = [float(err[a:b].max()) for a, b in zip(edges[:-1], edges[1:])]
    return AccuracyRow(spec.name, dtype, source, maxima, table_dtype, err.cpu())


def _unsupported(row: AccuracyRow) -> str | None:
    """The row's reason without its ``unsupported: `` prefix, or None where it ran or failed."""
    first = row.bucket_errors[0] if row.bucket_errors else None
    if isinstance(first, str) and first.startswith("unsupported: "):
        return first[len("unsupported: "):]
    return None


def unsupported_summary(rows: Sequence[AccuracyRow]) -> str:
    """The unsupported rows in one wrapped line, grouped by reason: an implementation none of
    whose rows ran is named alone, one that ran on some dtypes is named with the dtype it lacks."""
    from types import SimpleNamespace

    from ports.harness.report import unsupported_line

    never_ran = {r.impl for r in rows} - {r.impl for r in rows if _unsupported(r) is None}
    cells, seen = [], set()
    for r in rows:
        reason = _unsupported(r)
        label = r.impl if r.impl in never_ran or reason is None else f"{r.impl} {r.dtype}"
        if (label, reason) in seen:
            continue
        seen.add((label, reason))
        cells.append(SimpleNamespace(impl=label, reason=reason or "",
                                     status="ok" if reason is None else "unsupported"))
    return unsupported_line(cells)


def table(rows: Sequence[AccuracyRow], max_position: int = MAX_POSITION, fmt: str = "github",
          verbose: bool = True) -> str:
    """Max error per bucket, one row per (implementation, dtype, table dtype). Unless
    ``verbose``, the unsupported rows are summarised below the table in one line."""
    from ports.harness.report import text_table

    labels = bucket_labels(max_position)
    headers = ["implementation", "dtype", "cos/sin from", *labels]
    shown = rows if verbose else [r for r in rows if _unsupported(r) is None]
    body = []
    for r in shown:
        if r.bucket_errors and isinstance(r.bucket_errors[0], str):
            cells = [r.bucket_errors[0]] + ["-"] * (len(labels) - 1)
        else:
            cells = [f"{e:.1e}" for e in r.bucket_errors]
        body.append([r.impl, r.dtype, r.source, *cells])
    text = text_table(body, headers, fmt, fit=True)
    if not verbose and len(shown) < len(rows):
        text += "\n\n" + unsupported_summary(rows) + "\n(--verbose: a row for each)"
    return text


def plot(rows: Sequence[AccuracyRow], path: str) -> None:
    """Max error against position (log-log), one panel per dtype. Each implementation keeps one
    colour and marker in every panel; the line is dashed where its cos/sin table was in x's
    dtype. One legend for the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ports.harness import plotstyle

    drawn = [r for r in rows if r.per_token is not None]
    style = plotstyle.styles(r.impl for r in drawn)
    table_line = {"fp32": "-", "same": "--"}
    dtypes = list(dict.fromkeys(r.dtype for r in drawn))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    edges = torch.logspace(0, 17, 69, base=2).long().unique()
    for ax, dtype in zip(axes[0], dtypes):
        for r in (r for r in drawn if r.dtype == dtype):
            mids, vals = [], []
            for a, b in zip(edges[:-1].tolist(), edges[1:].tolist()):
                if a < len(r.per_token):
                    mids.append((a * b) ** 0.5)
                    vals.append(float(r.per_token[a:b].max()))
            kw = dict(style[r.impl], linestyle=table_line.get(r.table_dtype, "-"))
            ax.plot(mids, vals, linewidth=1, markersize=3, markevery=6, **kw)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("token position")
        ax.set_ylabel("max |out - float64 ideal|")
        ax.set_title(dtype)
        ax.grid(True, which="both", alpha=0.3)
    entries = [(impl, dict(kw, linestyle="-")) for impl, kw in style.items()]
    if any(r.table_dtype == "same" for r in drawn):
        entries += [("cos/sin table in fp32 (or computed)", {"color": "black", "linestyle": "-"}),
                    ("cos/sin table in x's dtype", {"color": "black", "linestyle": "--"})]
    plotstyle.figure_legend(fig, entries)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
