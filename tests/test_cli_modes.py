"""compare.py's modes: the needs-a-GPU status, plots without times, readable tables."""
from __future__ import annotations

import pytest
import torch

from ports.harness import cli, metrics, report
from ports.harness.result import CaseReport, Result
from reference.case import RopeCase

NO_GPU = not torch.cuda.is_available()


def run(capsys, *argv):
    code = cli.main(["--no-progress", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.skipif(not NO_GPU, reason="the no-GPU answers of the GPU-only modes")
@pytest.mark.parametrize("argv", [["--overhead"], ["--claims"],
                                  ["--shape", "1x4x1x8", "--plot", "bw.png"]])
def test_gpu_modes_say_so_in_one_line_with_one_status(capsys, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv)
    assert code == cli.EXIT_NEEDS_GPU == 3
    assert len(err.strip().splitlines()) == 1 and "needs" in err and "NVIDIA GPU" in err
    assert not (tmp_path / "bw.png").exists()


def test_plot_without_times_writes_nothing(capsys, tmp_path, monkeypatch):
    from ports.harness import env

    # a GPU machine whose run timed nothing: the up-front check passes, the CPU runs the case
    monkeypatch.setattr(env, "has_gpu", lambda: True)
    monkeypatch.setattr(env, "device", lambda: torch.device("cpu"))
    monkeypatch.setattr(env, "targets", lambda: frozenset({"cpu"}))
    path = tmp_path / "bw.png"
    code, _, err = run(capsys, "--shape", "1x4x1x8", "--only", "torch.hf_rotate_half",
                       "--plot", str(path))
    assert code == 1 and "no times to plot" in err and not path.exists()


def test_default_table_lists_unsupported_in_one_line(capsys):
    code, out, _ = run(capsys, "--suite", "smoke")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= report.WIDTH
    tables = out.split("## ")[1:]
    assert all("\nunsupported: " in t for t in tables)
    for t in tables:  # no table row for an unsupported implementation
        rows = [line for line in t.splitlines() if line.startswith("| ")]
        assert not any("unsupported" in row for row in rows)
    if NO_GPU:
        flat = " ".join(out.split())
        # the names before "(needs an NVIDIA GPU (cupy))", back to the previous group's ";"
        cupy_group = flat.split(" (needs an NVIDIA GPU (cupy))")[0].rsplit(":", 1)[-1]
        cupy_names = [n.strip() for n in cupy_group.rsplit(";", 1)[-1].split(",")]
        for family in ("leetcuda.*", "apex.*", "paddle.*", "oneflow.*", "fastrope.*",
                       "flashinfer_port.*", "sglang.*", "vllm_port.rotary_embedding"):
            assert family in cupy_names, cupy_names
        assert "no times: timing needs an NVIDIA GPU" in out


def timed(name, us, graph_us=None, status="ok", reason=""):
    return Result(name, "f", "port", status, reason, max_abs_err=0.0, max_rel_err=0.0,
                  err_over_tol=0.0, median_us=us, graph_us=graph_us)


def test_unsupported_line_groups_reasons_and_prefixes():
    results = [timed("a.one", 1.0),
               Result("b.one", "f", "port", "unsupported", "needs sbhd"),
               Result("b.two", "f", "port", "unsupported", "needs sbhd"),
               Result("c.one", "f", "port", "unsupported", "needs sbhd"),
               Result("c.two", "f", "port", "unsupported", "no backward")]
    assert report.unsupported_line(results) == (
        "unsupported: b.*, c.one (needs sbhd); c.two (no backward)")
    assert report.unsupported_line(results[:1]) == ""


def test_host_bound_times_are_marked():
    case = RopeCase(1, 4, 1, 8)
    results = [timed("graphed", 50.0, graph_us=10.0), timed("kernel", 12.0, graph_us=10.0),
               timed("tiny", 30.0)]
    metrics.derive(results, io_bytes=case.io_bytes(), copy_same_us=3.0)
    assert [r.host_bound for r in results] == [True, False, True]
    big = [timed("big", 30.0)]
    metrics.derive(big, io_bytes=case.io_bytes(), copy_same_us=metrics.TINY_COPY_US * 2)
    assert not big[0].host_bound  # not a tiny case: twice the copy is the kernel's own time
    text = report.case_table(CaseReport(case, results, 3000.0, None, 3.0), graph=True)
    assert "| 50.0* " in text and "| 12.0 " in text and text.count(report.HOST_BOUND_NOTE) == 1


def test_failures_are_short_in_the_row_and_full_below():
    case = RopeCase(1, 4, 1, 8)
    results = [timed("good", None), Result("bad", "f", "port", "FAIL", "max error 1 exceeds "
                                           "tolerance (9x)", 1.0, 1.0, 9.0)]
    text = report.case_table(CaseReport(case, results, None, None))
    row = next(line for line in text.splitlines() if line.startswith("| bad "))
    assert row.split("|")[2].strip() == "FAIL"
    assert "bad: FAIL: max error 1 exceeds tolerance (9x)" in text


def test_one_style_per_implementation_in_every_panel():
    from ports.harness import plotstyle

    names = [f"impl{i}" for i in range(25)]
    styles = plotstyle.styles(names + names[:3])
    assert list(styles) == names  # one entry per name, in order
    keys = {(s["color"], s["marker"], s["linestyle"]) for s in styles.values()}
    assert len(keys) == len(names)  # distinct beyond the 10-colour cycle


def test_accuracy_plot_has_one_legend_matching_every_panel(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ports.harness import accuracy

    per_token = torch.linspace(1e-7, 1e-5, 2048)
    rows = [accuracy.AccuracyRow(impl, dtype, "src", [1e-6], table, per_token)
            for dtype in ("fp32", "bf16") for impl in ("a", "b", "c")
            for table in (("fp32",) if dtype == "fp32" else ("fp32", "same"))]
    saved = {}
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: saved.setdefault("fig", fig))
    accuracy.plot(rows, str(tmp_path / "acc.png"))
    fig = saved["fig"]
    assert len(fig.legends) == 1 and not any(ax.get_legend() for ax in fig.axes)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:3] == ["a", "b", "c"]
    colours = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            colours.setdefault(line.get_color(), set()).add(line.get_marker())
    assert len(colours) == 3 and all(len(m) == 1 for m in colours.values())
    for ax in fig.axes:  # the same implementation keeps its colour in every panel
        assert {line.get_color() for line in ax.get_lines()} == set(colours)


@pytest.mark.parametrize("mode", ["--list", "--design"])
def test_listings_fit_unless_verbose(capsys, mode):
    from ports import registry

    code, out, _ = run(capsys, mode)
    assert code == 0 and max(len(line) for line in out.splitlines()) <= report.WIDTH
    names = {s.name for s in registry.REGISTRY if s.kind != "ablation" or mode == "--list"}
    assert names <= {cell.strip() for line in out.splitlines() for cell in line.split("|")}
    code, out, _ = run(capsys, mode, "--verbose")
    assert code == 0 and max(len(line) for line in out.splitlines()) > report.WIDTH
    assert len(out.splitlines()) == 2 + len(names)  # one line per row
    if mode == "--list":
        assert registry.get("torch.hf_rotate_half").upstream in out


def test_text_table_wraps_between_words_to_fit():
    rows = [["name.one", "a b c d e f g h " * 12, "x"]]
    text = report.text_table(rows, ["name", "words", "z"], fit=True)
    assert max(len(line) for line in text.splitlines()) <= report.WIDTH
    assert len(text.splitlines()) > 3 and "| name.one " in text
    unwrapped = report.text_table(rows, ["name", "words", "z"])
    assert len(unwrapped.splitlines()) == 3


def test_graph_table_with_the_longest_names_fits():
    case = RopeCase(1, 4, 1, 8)
    results = [timed("fastrope-ablation.sequence_per_block_row", 1234.5, 99.9),
               timed("torch.compile(hf_rotate_half)", 1000.0, 90.0)]
    metrics.derive(results, io_bytes=case.io_bytes(), copy_gbps=3000.0, copy_same_us=3.0,
                   baseline="torch.compile(hf_rotate_half)",
                   compiled="torch.compile(hf_rotate_half)")
    text = report.case_table(CaseReport(case, results, 3000.0, None, 3.0), graph=True)
    assert max(len(line) for line in text.splitlines()) <= report.WIDTH
    assert "| 1234.5* " in text and "| 1.23 " in text
