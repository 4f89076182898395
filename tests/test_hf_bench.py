"""The end-to-end benchmark's plumbing on CPU (ports/harness/hf_bench.py): every mode and
variant runs on a tiny model, repetitions alternate, the table, the CSV and the results data
file carry every cell, and bad arguments exit 2 with one line. Skipped without
transformers."""
from __future__ import annotations

import csv
import json
import re

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
    assert "| llama | tiny | train | fastrope |" in printed
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


def test_data_file_renders_and_merges_runs(tmp_path):
    """``--json`` writes a data file tools/results_tables.py renders, with the provenance its
    tests ask for; a second run adds its cells and command; another machine's file is refused."""
    from tools import results_tables as rt

    out = tmp_path / "hf-bench.json"
    assert hf_bench.main([*ARGS, "--family", "qwen3", "--modes", "train,prefill",
                          "--json", str(out)]) == 0
    assert hf_bench.main([*ARGS, "--family", "llama", "--modes", "train",
                          "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    named = tmp_path / "named.json"  # --commit names the tree where the checkout's git is not it
    assert hf_bench.main([*ARGS, "--family", "llama", "--modes", "train", "--commit", "abc1234",
                          "--json", str(named)]) == 0
    named_data = json.loads(named.read_text())
    assert named_data["commit"] == "abc1234"
    assert {c["git_sha"] for c in named_data["cells"]} == {"abc1234"}
    assert len(data["command"]) == 2 and data["command"][1].endswith(f"--json {out}")
    for key in ("command", "commit", "gpu", "driver", "versions", "date"):
        assert data[key], key
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", data["date"])
    first = [tuple(r[:4]) for r in data["rows"]]
    assert first[:4] == [("qwen3", "tiny", "train", v) for v in
                         ("unpatched", "fastrope", "fastrope+qknorm", "liger")]
    assert ("llama", "tiny", "train", "fastrope") in first and len(first) == 4 + 4 + 3
    fused = next(r for r in data["rows"] if r[3] == "fastrope+qknorm")
    assert fused[5] == "ms" and re.fullmatch(r"[\d.]+ \[[\d.]+, [\d.]+\]", fused[4])
    text = rt.render("hf-bench", {"hf-bench": data})
    assert text.startswith("| family | size | mode | variant | median [min, max] |")
    assert "| qwen3 | tiny | train | fastrope+qknorm |" in text
    data["gpu"] = "another GPU"  # not this machine's, whatever it is
    out.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as exit_info:
        hf_bench.main([*ARGS, "--family", "llama", "--modes", "train", "--json", str(out)])
    assert exit_info.value.code == 2


def test_olmo2_fused_variant_states_why_not():
    found = hf_bench.variants("olmo2", liger=False, device=torch.device("cpu"))
    assert found["fastrope+qknorm"].startswith("unsupported: OLMo2 normalises q and k over all")
    assert "fastrope+qknorm" not in hf_bench.variants("llama", liger=False,
                                                      device=torch.device("cpu"))


def test_a_mode_that_raises_is_a_cell_with_the_reason(tmp_path, monkeypatch, capsys):
    """An OOM or a compile failure in one mode leaves its cells a status; the others run."""
    real = hf_bench.Workload.measure

    def measure(self, iters, variant):
        if self.mode == "decode":
            raise RuntimeError("compile failed\nwith a long traceback")
        return real(self, iters, variant)

    monkeypatch.setattr(hf_bench.Workload, "measure", measure)
    out = tmp_path / "hf.csv"
    assert hf_bench.main([*ARGS, "--family", "llama", "--csv", str(out)]) == 0
    cells = {(r["mode"], r["variant"]): r for r in csv.DictReader(out.open())}
    assert cells[("decode", "fastrope")]["status"] == "error: RuntimeError: compile failed"
    assert cells[("train", "fastrope")]["status"] == "ok"
    assert "(error: RuntimeError: compile failed)" in capsys.readouterr().err


def test_a_variant_installs_the_same_functions_every_time():
    """What a variant's warm-up compiled and its decode graph captured is what its later
    repetitions install: the same function objects every time."""
    from ports.fastrope import hf

    found = hf_bench.variants("qwen3", liger=False, device=torch.device("cpu"))
    module = hf.module_of(hf.FAMILIES["qwen3"])
    before = module.apply_rotary_pos_emb, module.Qwen3Attention.forward
    seen = []
    for _ in range(2):
        with found["fastrope+qknorm"]():
            seen.append((module.apply_rotary_pos_emb, module.Qwen3Attention.forward))
        assert (module.apply_rotary_pos_emb, module.Qwen3Attention.forward) == before
    assert seen[0] == seen[1] and seen[0][1].family is hf.FAMILIES["qwen3"]


@pytest.mark.parametrize("family", ["llama", "glm4"])
def test_decode_loop_is_generate_and_redoes_the_same_steps(family):
    """The timed decode loop gives ``generate``'s greedy tokens, and a second run (a graph's
    next replay) rewinds the static cache and gives them again."""
    from ports.fastrope import hf_models

    model = hf_models.model(family, hf_models.TINY, dtype=torch.float32,
                            device=torch.device("cpu"), attention="sdpa")
    ids = torch.randint(3, hf_models.TINY.vocab, (2, 16),
                        generator=torch.Generator().manual_seed(0))
    loop = hf_bench.DecodeLoop(model, ids, 3)
    first, second = loop.run(), loop.run()
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=4, min_new_tokens=4)[:, -1:]
    assert torch.equal(first, expected) and torch.equal(second, expected)


def test_decode_loop_refuses_a_window_that_would_roll():
    from ports.fastrope import hf_models

    model = hf_models.model("gemma2", hf_models.TINY, dtype=torch.float32,
                            device=torch.device("cpu"), attention="sdpa")
    with pytest.raises(ValueError, match="sliding window of 8 tokens is shorter than the prompt"):
        hf_bench.DecodeLoop(model, torch.randint(3, 100, (1, 16)), 2)
