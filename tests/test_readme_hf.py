"""The README's Hugging Face snippets run as written, in order in one namespace as a reader runs
them, on CPU: ``"cuda"`` read as ``"cpu"``, the
kernels served on CPU tensors (the rotary through test_hf.py's float64 emulation of
``apply_rope``, the fused QK-norm through the real kernel under TRITON_INTERPRET=1) and
kernelize given a CPU entry for fastrope's repository (test_hf.py's ``cpu_mapping``). Each
snippet must reach fastrope. Skipped without transformers and kernels."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs Hugging Face transformers: pip install -e "
                                           "'.[hf]'")
pytest.importorskip("kernels", reason="needs Hugging Face kernels: pip install -e '.[hf]'")

from ports import _triton  # noqa: E402
from ports.fastrope import hf_kernels, hf_qknorm  # noqa: E402
from test_hf import cpu_mapping, emulated  # noqa: E402,F401 - fixtures
from test_readme import code_blocks, section  # noqa: E402

pytestmark = pytest.mark.filterwarnings(r"ignore:(?s)\s*No kernel mapping found:UserWarning")

SNIPPETS = code_blocks(section("fastrope in a model"))


def _run(*snippets: str) -> None:
    namespace: dict = {}
    for snippet in snippets:
        exec(compile(snippet.replace('"cuda"', '"cpu"'), "README.md", "exec"), namespace)


def test_the_section_shows_kernelize_then_patch():
    assert len(SNIPPETS) == 2
    assert "kernelize(" in SNIPPETS[0] and "patch(" in SNIPPETS[1]
    assert all(len(s.splitlines()) <= 12 for s in SNIPPETS), "a few lines each"


def test_kernelize_snippet_reaches_fastrope(emulated, cpu_mapping, monkeypatch):  # noqa: F811
    monkeypatch.setattr(hf_kernels, "kernel_mapping", lambda: cpu_mapping)
    _run(SNIPPETS[0])
    assert emulated.calls


@pytest.mark.skipif(not _triton.interpreting(),
                    reason="the fused kernel on CPU tensors needs TRITON_INTERPRET=1 (conftest sets "
                           "it where there is no GPU); tests/test_gpu_hf.py runs it on the GPU")
def test_patch_snippet_reaches_the_fused_kernel(emulated, cpu_mapping,  # noqa: F811
                                               monkeypatch):
    calls = []
    real = hf_qknorm.qk_norm_rope

    def qk_norm_rope(*args, **kwargs):
        calls.append(kwargs["layout"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_kernels, "kernel_mapping", lambda: cpu_mapping)
    monkeypatch.setattr(hf_qknorm, "qk_norm_rope", qk_norm_rope)
    _run(*SNIPPETS)
    assert calls
