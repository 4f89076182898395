"""Checks ``compare.py`` makes before any work, so that a run it cannot finish fails in one line
at once instead of in a traceback at the end (or after many minutes on a CPU).

* ``--plot`` needs matplotlib: checked before anything is run.
* Every output path (``--json``, ``--csv``, ``--plot``) must be writable and every results file
  read (``--summary``, ``--design``) must exist: checked before torch is imported.
* Without a GPU, every case is cross-validated by the float64 oracle, the eager references and
  the Triton interpreter (which runs each Triton program, one per row or block, in Python), so
  cases are capped at :data:`CPU_MAX_ELEMENTS` elements per tensor. A suite keeps the cases under
  the cap and names the rest; a run with none left is refused.
* Without a GPU, ``--accuracy`` measures positions up to :data:`CPU_MAX_POSITION` (not 128k).
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Sequence

CPU_MAX_ELEMENTS = 8192       # per tensor: 2x32x4x32 (the smoke suite's cases hold 4096)
CPU_MAX_POSITION = 16384      # --accuracy without a GPU
SMALL_SHAPE = "2x32x4x32"     # what the refusal suggests (at the cap)

RESULTS_HINT = "give a file written by compare.py --json PATH (with --shape or --suite)"
INSTALL_HINT = "pip install -e '.[cuda13]' (or pip install {package})"


def missing_package(module: str, package: str, feature: str) -> str | None:
    """``None`` if ``module`` imports; else one line: the feature, what is missing, the command."""
    try:
        importlib.import_module(module)
    except ImportError:
        return (f"{feature} needs {package}, which is not installed: "
                + INSTALL_HINT.format(package=package))
    return None


# The file types matplotlib's default (Agg, PDF, SVG, PS, PGF) backends write; no suffix is PNG.
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp",
                "gif", "avif", "pgf", "raw", "rgba")


def plot_problem(plot_path: str | None) -> str | None:
    """Why ``--plot PATH`` cannot be honoured (matplotlib missing, or a file type it does not
    write), or ``None``."""
    if plot_path is None:
        return None
    suffix = os.path.splitext(plot_path)[1].lower().lstrip(".")
    if suffix and suffix not in PLOT_FORMATS:
        return (f"--plot {plot_path}: matplotlib does not write .{suffix} files; end the path in "
                ".png, .pdf or .svg")
    return missing_package("matplotlib", "matplotlib", "--plot")


def output_problem(flag: str, path: str | None, stdout: bool = True) -> str | None:
    """Why ``flag PATH`` cannot be written (one line with what would be right), or ``None``;
    ``-`` is standard output where ``stdout``."""
    if path is None or (stdout and path == "-"):
        return None
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        return f"{flag} {path}: is a folder; give a file path in it"
    if not os.path.isdir(folder):
        return f"{flag} {path}: folder {folder} does not exist; create it or give another path"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag} {path}: cannot write there (permission denied); give a writable path"
    return None


def results_file_problem(flag: str, path: str) -> str | None:
    """Why ``flag PATH`` is not a results file to read (missing, or a folder), or ``None``."""
    if os.path.isdir(path):
        return f"{flag} {path}: is a folder; {RESULTS_HINT}"
    if not os.path.exists(path):
        return f"{flag} {path}: no such file; {RESULTS_HINT}"
    return None


def over_cpu_cap(cases: Sequence) -> list:
    """The cases whose largest tensor has more elements than a CPU run takes."""
    return [c for c in cases if c.numel > CPU_MAX_ELEMENTS]


def cpu_refusal(cases: Sequence) -> str:
    """One line: why these cases are not run on a CPU, and what to run instead."""
    biggest = max(cases, key=lambda c: c.numel)
    return (f"without a GPU, cases are capped at {CPU_MAX_ELEMENTS:,} elements per tensor (the CPU "
            f"runs the float64 oracle and the Triton interpreter); {biggest.describe()} has "
            f"{biggest.numel:,}. Try --suite smoke, or a small shape such as --shape {SMALL_SHAPE}")


def cpu_skip_note(skipped: Sequence) -> str:
    """One line naming the cases a CPU run leaves out."""
    names = ", ".join(dict.fromkeys(c.describe() for c in skipped))
    return (f"No GPU: {len(skipped)} case(s) over the CPU cap of {CPU_MAX_ELEMENTS:,} elements per "
            f"tensor left out: {names}")
