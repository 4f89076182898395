"""The end-to-end benchmark's plumbing on CPU (ports/harness/hf_bench.py): every mode and
variant runs on a tiny model, repetitions alternate, the table and the CSV carry every cell, and
bad arguments exit 2 with one line. Skipped without transformers."""
from __future__ import annotations

import csv

import pytest

pytest.importorskip("transformers", reason="needs Hugging Face transformers: pip install -e "
                                           "'.[hf]'")

import torch  # noqa: E402

from ports.harness import hf_bench  # noqa: E402

ARGS = ["--size", "tiny", "--reps", "2", "--iters", "1", "--warmup", "1", "--batch", "2",
        "--seq", "8", "--prefill", "16", "--new-tokens", "2", "--device", "cpu", "--liger"]


def test_every_cell_is_a_number_or_a_reason(tmp_path, capsys):
    out = tmp_path / "hf.csv"
    assert hf_bench.main([*ARGS, "--family", "llama,glm4", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    cells = {(r["family"], r["mode"], r["variant"]): r for r in rows}
    for family in ("llama", "glm4"):
        for mode in hf_bench.MODES:
            for variant in ("unpatched", "fastrope"):
                row = cells[(family, mode, variant)]
                assert row["status"] == "ok" and float(row["min"]) <= float(row["median"]) \
                    <= float(row["max"])
    assert cells[("glm4", "train", "liger")]["status"].startswith(("unsupported", "not installed"))
    assert cells[("llama", "decode", "fastrope")]["unit"] == "tokens/s"
    printed = capsys.readouterr().out
    assert "| llama | train | fastrope |" in printed
    assert ("none (CPU)" in printed) == (not torch.cuda.is_available())  # the machine's GPU
    hf_bench.main([*ARGS, "--family", "llama", "--modes", "train", "--csv", str(out)])
    assert len(list(csv.DictReader(out.open()))) == len(rows) + 3  # appended, one header


@pytest.mark.parametrize("argv,message", [
    (["--family", "falcon"], "unknown family falcon; expected cohere,"),
    (["--modes", "train,fly"], "unknown mode fly; expected decode, prefill, train"),
    (["--reps", "0"], "--reps and --iters must be at least 1"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        hf_bench.main([*ARGS, *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
