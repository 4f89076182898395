"""The README as a newcomer meets it: short, a venv, the CUDA build picked without torch, every
family, layout and case tag defined, a sample output that a real run prints, and a map of the
top-level folders."""
import dataclasses
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_GPU
from ports import registry
from reference import vocabulary
from reference.case import RopeCase

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    """The text under '## TITLE', up to the next '## ' heading outside a code block."""
    lines, inside, in_code = [], False, False
    for line in README.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("## "):
            inside = line == f"## {title}"
        if inside:
            lines.append(line)
    assert lines, f"no '## {title}' section"
    return "\n".join(lines) + "\n"


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```\w*\n(.*?)```", text, re.S)


def ci_setup_commands() -> list[str]:
    """The lines .ci/run runs: the ci:setup block without fences, comments and blank lines."""
    block = README[README.index("<!-- ci:setup:begin -->"):README.index("<!-- ci:setup:end -->")]
    return [line for line in block.splitlines()[1:]
            if line.strip() and not line.startswith("```") and not line.lstrip().startswith("#")]


def test_readme_is_at_most_250_lines():
    assert len(README.splitlines()) <= 250


def test_setup_makes_and_activates_a_venv_before_installing():
    setup = section("Set-up")
    venv = setup.find("python3 -m venv .venv")
    assert venv >= 0, "the set-up makes no virtual environment"
    activate = re.search(r"(^|&& |; )(\.|source) \.venv/bin/activate", setup, re.M)
    assert activate, "the venv is not activated"
    assert venv < setup.index("<!-- ci:setup:begin -->")
    assert ".venv/" in (ROOT / ".gitignore").read_text().splitlines()


def test_ci_setup_lines_run_one_by_one():
    """.ci/run gives each line its own bash: no continuation lines, no cd or activation to carry."""
    commands = ci_setup_commands()
    assert any(c.startswith("pip install -e") for c in commands)
    assert any(c.startswith("python compare.py") for c in commands)
    for c in commands:
        assert not c.rstrip().endswith("\\"), c
        assert not re.match(r"(cd|source|\.) ", c), c


def install_line() -> str:
    return next(c for c in ci_setup_commands() if c.startswith("pip install -e"))


def test_the_cuda_pick_does_not_need_torch():
    assert "torch" not in install_line()
    assert "nvidia-smi" in install_line()


@pytest.mark.parametrize("smi_output, extra", [
    ("| NVIDIA-SMI 535.104.05   Driver Version: 535.104.05   CUDA Version: 12.2     |", "cuda12"),
    ("| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0     |", "cuda13"),
    (None, "cuda13"),  # no GPU: nvidia-smi fails (or is absent), as on CI
])
def test_the_cuda_pick_follows_nvidia_smi(tmp_path, smi_output, extra):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + (f"echo '{smi_output}'\n" if smi_output else "exit 9\n"))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    echo = "echo " + install_line().removeprefix("pip install -e ").split("#")[0]
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", echo], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f".[{extra}]"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf"^{extra} = ", pyproject, re.M), f"no extra {extra} in pyproject.toml"


def glossary() -> str:
    return section("Glossary")


@pytest.mark.parametrize("family", [*registry.FAMILIES, registry.USER_FAMILY])
def test_every_family_is_in_the_glossary(family):
    rows = [line for line in glossary().splitlines() if line.startswith("| `")]
    named = any(f"`{family}`" in line.split(" | ")[0] for line in rows)
    assert named, f"family {family!r} not in the glossary"


@pytest.mark.parametrize("layout", vocabulary.LAYOUTS)
def test_every_layout_is_in_the_glossary(layout):
    assert re.search(rf"^\| `{layout}` \|", glossary(), re.M), f"layout {layout!r} not defined"


# The fields of RopeCase that give no tag (they make the title, or are not shown), and one
# non-default value for each field that does. A new field fails test_every_case_field_is_known.
UNTAGGED = {"batch", "seqlen", "heads", "head_dim", "layout", "dtype", "style", "seqlens",
            "max_position", "label"}
VARIANTS = {
    "rotary_dim": [{"rotary_dim": 16}],
    "positions": [{"positions": p} for p in vocabulary.POSITION_KINDS if p != "arange"],
    "base": [{"base": 500000.0}],
    "cos_sin_dtype": [{"cos_sin_dtype": d} for d in vocabulary.COS_SIN_DTYPES if d != "fp32"],
    "direction": [{"direction": "backward"}],
    "grad": [{"direction": "backward", "grad": g} for g in vocabulary.GRAD_KINDS],
    "contiguous": [{"contiguous": False}],
    "asymmetric": [{"asymmetric": True}],
    "kv_heads": [{"kv_heads": 2}],
    "with_v": [{"kv_heads": 2, "with_v": True}],
}
PLAIN = RopeCase(2, 16, 4, 32)


def case_tags() -> set[str]:
    """Every tag RopeCase.describe() can add to a case's title, from one variant per field."""
    tags = set()
    for changes in (c for options in VARIANTS.values() for c in options):
        described = PLAIN.replace(**changes).describe()
        assert described.startswith(PLAIN.describe())
        tags.add(described[len(PLAIN.describe()):].strip())
    return tags


def test_every_case_field_is_known():
    fields = {f.name for f in dataclasses.fields(RopeCase)}
    assert fields == UNTAGGED | set(VARIANTS), "a RopeCase field changed: update VARIANTS, tags"


@pytest.mark.parametrize("tag", sorted(case_tags()))
def test_every_case_tag_is_defined(tag):
    """A tag's numbers may differ in the glossary (R=64 for R=16); its words may not."""
    pattern = re.sub(r"\\?\d[\d.e+]*", r"[\\d.e+]+", re.escape(tag))
    assert re.search(rf"`{pattern}`", glossary()), f"case tag {tag!r} is not in the glossary"


def sample_output() -> tuple[list[str], list[str]]:
    """The command the README's sample shows, and the lines it shows (up to its '...')."""
    block = next(b for b in code_blocks(section("Set-up")) if b.startswith("$ python compare.py"))
    lines = block.splitlines()
    shown = lines[1:lines.index("...")]
    return lines[0].removeprefix("$ python compare.py ").split(), shown


@pytest.mark.skipif(HAS_GPU, reason="the README's sample is a run on a machine without a GPU")
def test_the_sample_output_is_what_a_cpu_run_prints():
    argv, shown = sample_output()
    assert len(shown) >= 5 and shown[0].startswith("No CUDA GPU found")
    proc = subprocess.run([sys.executable, "compare.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[:len(shown)] == shown


def test_the_map_names_every_top_level_folder_and_file():
    proc = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip("not a git checkout: no list of tracked files to compare with")
    top = {p.split("/")[0] + ("/" if "/" in p else "") for p in proc.stdout.split()}
    house = code_blocks(section("Files"))[0]
    listed = set(re.findall(r"[\w.\-]+/?", house))
    assert not top - listed, f"not in the README's map: {sorted(top - listed)}"
