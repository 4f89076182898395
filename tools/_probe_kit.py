"""What the probes under tools/ share (GPU only): inputs, and the results data file they write.

Not a tool itself; the tools import it (run them from the repository root with ``python -m``).
Kernel variants and fixed plans come from the package's experiment interface,
``ports.fastrope.experiment``.
"""
from __future__ import annotations

import json
import shlex
import sys

import torch

from ports.harness.env import driver_version, metadata
from reference.tables import first_members

__all__ = ["decode_inputs", "make", "output_arguments", "parse_probe_arguments", "probe_parser",
           "qknorm_shapes", "registry_arguments", "require_gpu", "write_data_file",
           "write_requested"]


def make(layout, shape, dtype):
    """x in ``layout`` for ``shape`` (b, s, h, d) and full-width rotate-half tables in x's dtype
    (angles from base 10000 in fp64)."""
    b, s, h, d = shape
    x = torch.randn((s, b, h, d) if layout == "sbhd" else (b, s, h, d), device="cuda", dtype=dtype)
    ang = torch.arange(s, device="cuda", dtype=torch.float64)[:, None] * (
        10000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float64) / d))
    ang = torch.cat([ang, ang], -1)
    return x, ang.cos().to(dtype), ang.sin().to(dtype)


def decode_inputs(b=64):
    """A decode step: x [b, 1, 32, 128] bf16, 4k-row tables, one offset per sequence, and the
    rows torch.compile's call gets gathered beforehand."""
    x = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    _, cos, sin = make("bshd", (1, 4096, 1, 128), torch.bfloat16)
    offs = torch.randint(0, 4095, (b,), device="cuda")
    return x, cos, sin, offs, cos[offs][:, None, :], sin[offs][:, None, :]


def registry_arguments(case, inputs) -> dict:
    """fastrope's arguments as the registry rows pass them (fastrope/canonical.py) for a case of
    the suites: half-width tables (their tables are symmetric), the case's positions, no position
    check."""
    kw = dict(style=case.style, layout=case.layout, rotary_dim=case.rot_dim,
              check_positions=False, cos=first_members(inputs.cos, case.style).contiguous(),
              sin=first_members(inputs.sin, case.style).contiguous())
    if case.positions == "offset":
        kw.update(offsets=inputs.offsets)
    elif case.positions == "ids":
        kw.update(positions=inputs.positions)
    return kw


def write_data_file(path: str, *, tool: str, argv, section: str, context: str,
                    commit: str | None, columns: list[str], rows: list[list[str]]) -> None:
    """A results data file (tools/results_tables.py's format) for one run of ``python -m
    tool`` with ``argv`` (None: this process's arguments): the table, its provenance from this
    machine, and ``commit`` (None: the checkout's git)."""
    meta = metadata()
    data = {
        "document": "results/README.md", "section": section, "context": context,
        "command": [shlex.join(["python", "-m", tool, *(sys.argv[1:] if argv is None else argv)])],
        "commit": commit or meta["git_sha"], "gpu": meta["gpu"], "driver": driver_version(),
        "versions": {k: meta[k] for k in ("torch", "triton", "cupy")},
        "date": meta["timestamp"][:10], "columns": columns, "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def write_requested(args, argv, *, tool: str, doc: str, section: str, columns: list[str],
                    rows: list[list[str]], more_context: str = "") -> None:
    """The run's results data file where it asked for one (:func:`output_arguments`' ``--json``
    and ``--commit``), its context the probe's docstring ``doc`` (the paragraph after its title,
    on one line) and ``more_context``."""
    if args.json:
        context = " ".join(doc.split("\n\n")[1].split()) + more_context
        write_data_file(args.json, tool=tool, argv=argv, section=section, context=context,
                        commit=args.commit, columns=columns, rows=rows)


def output_arguments(ap) -> None:
    """The probes' ``--json`` (a results data file, :func:`write_data_file`) and ``--commit``."""
    ap.add_argument("--json", help="write a results data file here")
    ap.add_argument("--commit", help="the tree's commit, where the checkout's git is not it")


def probe_parser(tool: str, doc: str, *, reps: int):
    """The parser of probe ``tools.<tool>``: its title from ``doc``'s first line, ``--reps``
    (interleaved rounds, default ``reps``), ``--json`` and ``--commit``; a probe adds its own."""
    import argparse

    ap = argparse.ArgumentParser(prog=f"python -m {tool}", description=doc.split("\n")[0])
    ap.add_argument("--reps", type=int, default=reps,
                    help=f"interleaved rounds (default {reps})")
    output_arguments(ap)
    return ap


def parse_probe_arguments(ap, argv):
    """``ap``'s arguments from ``argv``; the parser's error for fewer than one round."""
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    return args


def require_gpu(ap) -> None:
    """The parser's error on a machine without a CUDA GPU (after the arguments are checked)."""
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU; none is visible")


def qknorm_shapes(ap, names: list[str]) -> list:
    """The qknorm suite's shapes (``qknorm_bench.SHAPES``) named ``names``, in order; the
    parser's error for an unknown name, then for a machine without a CUDA GPU."""
    from ports.harness import qknorm_bench

    known = {s.name: s for s in qknorm_bench.SHAPES}
    bad = [n for n in names if n not in known]
    if bad:
        ap.error(f"unknown shape {', '.join(bad)}; known: {', '.join(known)}")
    require_gpu(ap)
    return [known[n] for n in names]
