"""The probes' results data file (tools/_probe_kit.py) is one tools/results_tables.py renders,
with the run's command, commit and machine; the A/B probe refuses a --before that is not a
rope.cu, the qknorm probes an unknown shape, and the probes that take --reps a count below 1,
before they need a GPU; the traffic-pattern probe's copy kernels and the rows-backward probe's
kernels compile for sm_90."""
import json

import pytest
import torch

from tools import (_probe_kit, qknorm_minimal_probe, qknorm_rows_backward_probe,
                   qknorm_table_bytes_probe, results_tables, rows_given_probe,
                   shared_gradient_probe, source_ab_probe, traffic_pattern_probe)


def test_write_data_file_is_a_results_table(tmp_path):
    path = tmp_path / "run.json"
    _probe_kit.write_data_file(str(path), tool="tools.source_ab_probe",
                               argv=["--before", "b.cu", "--json", "run.json"], section="s",
                               context="c", commit="abc1234", columns=["case", "us"],
                               rows=[["x", "1.00"]])
    data = json.loads(path.read_text())
    assert data["command"] == ["python -m tools.source_ab_probe --before b.cu --json run.json"]
    assert data["commit"] == "abc1234" and data["gpu"] and data["date"]
    assert set(data["versions"]) == {"torch", "triton", "cupy"}
    table = results_tables.render("run", {"run": data})
    assert "| case | us |" in table and "| x | 1.00 |" in table


def test_source_ab_probe_refuses_a_file_that_is_not_rope_cu(tmp_path, capsys):
    bad = tmp_path / "k.cu"
    bad.write_text('extern "C" __global__ void k() {}')
    for args in (["--before", str(bad)], ["--before", str(tmp_path / "missing.cu")]):
        with pytest.raises(SystemExit) as e:
            source_ab_probe.main(args)
        assert e.value.code == 2
        assert "--before" in capsys.readouterr().err


@pytest.mark.parametrize("probe", [qknorm_table_bytes_probe, qknorm_minimal_probe,
                                   qknorm_rows_backward_probe])
def test_qknorm_probes_refuse_an_unknown_shape(capsys, probe):
    with pytest.raises(SystemExit) as e:
        probe.main(["--shapes", "qwen3-8b prefill 5k"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown shape qwen3-8b prefill 5k" in err and "qwen3-8b prefill 4k" in err


@pytest.mark.parametrize("probe", [rows_given_probe, qknorm_minimal_probe,
                                   qknorm_rows_backward_probe, traffic_pattern_probe])
def test_probes_refuse_fewer_than_one_round(capsys, probe):
    with pytest.raises(SystemExit) as e:
        probe.main(["--reps", "0"])
    assert e.value.code == 2
    assert "--reps must be at least 1, got 0" in capsys.readouterr().err


def test_write_requested_writes_only_where_asked(tmp_path):
    """--json given: a data file whose context is the docstring's paragraph after its title, on
    one line, then ``more_context``; no --json: nothing written."""
    import argparse

    doc = "Title line.\n\nFirst paragraph,\n  on two lines.\n\nUsage."
    kw = dict(tool="tools.x", doc=doc, section="s", columns=["a"], rows=[["1"]])
    path = tmp_path / "run.json"
    _probe_kit.write_requested(argparse.Namespace(json=None, commit=None), [], **kw)
    assert not path.exists()
    _probe_kit.write_requested(argparse.Namespace(json=str(path), commit="abc1234"),
                               ["--json", "run.json"], **kw, more_context=" More.")
    data = json.loads(path.read_text())
    assert data["context"] == "First paragraph, on two lines. More."
    assert data["commit"] == "abc1234" and data["rows"] == [["1"]]


def test_traffic_pattern_copy_kernels_compile_for_sm90():
    """Every copy kernel the probe launches, and its rotation, is in its source and compiles
    (NVRTC, no GPU)."""
    from ports import _cupy

    try:
        ptx, _ = _cupy.compile_source(traffic_pattern_probe.SOURCE, filename="copies.cu",
                                      options=(), name_expressions=(), arch="sm_90",
                                      method="ptx")
    except Exception as e:  # noqa: BLE001 - the reason is the skip's message
        pytest.skip(f"NVRTC cannot compile here: {e}")
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    names = [name for name, *_ in traffic_pattern_probe.COPIES.values()]
    for name in [*names, traffic_pattern_probe.ROTATION]:
        assert f".entry {name}(" in text, name


def test_qknorm_rows_backward_kernels_compile_for_sm90():
    """Every variant the rows-backward probe launches compiles (NVRTC, no GPU)."""
    from ports import _cupy

    p = qknorm_rows_backward_probe
    names = [f"rows_bwd<{r}, {b}>" for r, b in p.VARIANTS] + [
        f"rows_bwd_staged<{st}, {b}>" for st, b in p.STAGED]
    try:
        _, lowered = _cupy.compile_source(p.SOURCE, filename="rows_bwd.cu", options=(),
                                          name_expressions=names, arch="sm_90")
    except Exception as e:  # noqa: BLE001 - the reason is the skip's message
        pytest.skip(f"NVRTC cannot compile here: {e}")
    assert set(lowered) == set(names)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("probe", [rows_given_probe, traffic_pattern_probe,
                                   shared_gradient_probe])
def test_probes_refuse_a_machine_without_a_gpu(capsys, probe):
    with pytest.raises(SystemExit) as e:
        probe.main([])
    assert e.value.code == 2
    assert "needs a CUDA GPU; none is visible" in capsys.readouterr().err
