"""The registry is consistent, and every eager reference cross-validates on the CPU."""
from __future__ import annotations

import pytest

from ports import registry
from ports._spec import ALL_LAYOUTS, ALL_POSITIONS, ALL_STYLES
from ports.harness.runner import run_case
from ports.harness.suites import smoke
from reference.case import DTYPES, RopeCase
from reference.expected import TABLE_SOURCES


def test_names_unique_and_lookup():
    assert len(set(registry.NAMES)) == len(registry.NAMES)
    assert registry.get("leetcuda.rope_f32").family == "leetcuda"
    with pytest.raises(KeyError, match="closest: torch.hf_rotate_half"):
        registry.get("torch.hf_rotate_halve")
    with pytest.raises(KeyError, match="families: eager, leetcuda.*; backends: torch, cupy"):
        registry.get("no.such.kernel")


def test_families_and_backends_name_every_spec():
    assert {s.family for s in registry.REGISTRY} == set(registry.FAMILIES)
    assert {s.backend for s in registry.REGISTRY} == set(registry.BACKENDS)


def test_select_by_backend():
    triton = registry.select(only=["triton"])
    assert triton and {s.backend for s in triton} == {"triton"}
    assert {s.family for s in triton} == {"te_triton", "batch_reuse", "kernl"}
    no_cupy = registry.select(skip=["cupy"])
    assert no_cupy and "cupy" not in {s.backend for s in no_cupy}
    assert all(s.kind != "ablation" for s in registry.select(only=["cupy"]))
    with pytest.raises(KeyError, match="closest: cupy"):
        registry.select(skip=["cuppy"])


@pytest.mark.parametrize("spec", registry.REGISTRY, ids=lambda s: s.name)
def test_spec_fields_are_within_the_vocabulary(spec):
    assert spec.styles and spec.styles <= ALL_STYLES
    assert spec.layouts and spec.layouts <= ALL_LAYOUTS
    assert spec.dtypes and spec.dtypes <= set(DTYPES)
    assert spec.positions and spec.positions <= ALL_POSITIONS
    assert spec.table_source in TABLE_SOURCES
    assert spec.backend in ("torch", "cupy", "triton")
    assert spec.upstream and spec.summary
    assert spec.index_bits in (32, 64)
    for dtype in spec.dtypes:
        assert dtype in spec.tolerance_steps


@pytest.mark.parametrize("spec", registry.REGISTRY, ids=lambda s: s.name)
def test_unsupported_reason_names_the_limit(spec):
    other_style = next(iter(ALL_STYLES - spec.styles), None)
    case = RopeCase(1, 8, 1, 16, style=other_style or next(iter(spec.styles)))
    if other_style:
        assert "convention" in spec.unsupported_reason(case, spec.devices)
    if "cuda" not in spec.devices or spec.devices != {"cuda"}:
        return
    assert "NVIDIA GPU" in spec.unsupported_reason(case, {"cpu"})


def test_every_style_has_one_eager_baseline():
    for style in ALL_STYLES:
        case = RopeCase(1, 8, 1, 16, style=style)
        base = registry.baseline_for(case, {"cpu"})
        assert base is not None and base.kind == "baseline"


def test_select_by_family_and_skip():
    names = [s.name for s in registry.select(only=["leetcuda"], skip=["leetcuda.rope_f32_v2"])]
    assert names == ["leetcuda.rope_f32", "leetcuda.rope_f32x4_pack"]


def test_int32_designs_refuse_overflowing_cases():
    big = RopeCase(1, 2**21, 1, 1024, style="interleaved")  # 2^31 elements
    assert "int32" in registry.get("leetcuda.rope_f32").unsupported_reason(big)


@pytest.mark.parametrize("case", smoke(), ids=lambda c: c.describe())
def test_cpu_references_cross_validate(case):
    """Everything that can run on this CPU matches the float64 oracle on the smoke suite."""
    report = run_case(case, registry.REGISTRY, targets=frozenset({"cpu"}),
                      device=__import__("torch").device("cpu"), timing_on=False)
    ran = [r for r in report.results if r.status != "unsupported"]
    assert ran, "nothing ran: the smoke suite must exercise at least the baseline"
    bad = [(r.impl, r.status, r.reason) for r in ran if r.status != "ok"]
    assert not bad
    for r in report.results:
        if r.status == "unsupported":
            assert r.reason  # every unsupported cell says why


def test_earlier_row_names_still_select_their_rows():
    for old, new in registry.ALIASES.items():
        assert [s.name for s in registry.select([old])] == [s.name for s in registry.select([new])]
    assert registry.get("triton.te_seed000").name == "triton.te_style"


def test_the_old_import_path_warns_once_and_is_the_same_kernel():
    """``ports.study`` (the README's "old import path") still imports, with one
    DeprecationWarning however often it is imported."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import warnings\nwarnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    import ports.study\n    import ports.study as again\n"
            "import ports.fastrope\n"
            "print(sum(issubclass(w.category, DeprecationWarning) and 'ports.fastrope' in "
            "str(w.message) for w in seen), again.apply_rope is ports.fastrope.apply_rope)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.stdout.split() == ["1", "True"], proc.stderr[-2000:]
