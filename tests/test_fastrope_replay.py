"""replay.cpp without a GPU: it builds and registers the mutating ops' CUDA kernels, and the
launch words the Python side hands it round-trip the per-problem bytes.

The replayed calls themselves are tests/test_gpu_fastrope_replay.py.
"""
from __future__ import annotations

import shutil
import struct

import pytest
import torch
from torch.utils import cpp_extension

from ports.fastrope import launcher, ops, replay, run  # noqa: F401 - ops defines the ops

BUILD_TOOLS = (torch.version.cuda is not None and shutil.which("c++") is not None
               and cpp_extension.is_ninja_available())


@pytest.mark.skipif(not BUILD_TOOLS, reason="needs a CUDA build of torch, a C++ compiler and "
                                            "ninja to build replay.cpp")
def test_replay_cpp_builds_and_serves_the_mutating_ops_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # built here unless already loaded
    assert replay.build() == replay.build()  # one copy a process
    for name in ("rope_", "rope_out"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastrope::{name}", "CUDA")
    counts = torch.ops.fastrope.replay_counts()
    assert len(counts) == 2 and all(isinstance(c, int) and c >= 0 for c in counts)


def test_the_replay_switch_reads_the_environment(monkeypatch):
    monkeypatch.setenv(replay.ENVIRONMENT, "0")
    assert replay.disabled()
    monkeypatch.setenv(replay.ENVIRONMENT, "1")
    assert not replay.disabled()
    monkeypatch.delenv(replay.ENVIRONMENT)
    assert not replay.disabled()


@pytest.mark.parametrize("static", [launcher._STATIC, launcher._STEP_STATIC])
def test_a_launch_as_words_keeps_its_bytes(static):
    values = [(-1) ** i * (3 * i + 1) for i in range(len(static.unpack(bytes(static.size))))]
    packed = static.pack(*values)
    lc = launcher.Launch(function=0xDEADBEEF, grid=(7, 2, 1), block=(128, 1, 1), shared_mem=96,
                         static=packed, device=0, plan=None, dims=(), context=0,
                         launch_kernel=None, current_context=None, set_context=None)
    words = launcher.replay_words(lc, (0, 1))
    assert words[:10] == [0xDEADBEEF, 7, 2, 1, 128, 1, 1, 96, 0, 1]
    n = words[10]
    assert n == len(words) - 11 and n * 8 >= len(packed)
    assert struct.pack(f"<{n}q", *words[11:])[:len(packed)] == packed
    assert launcher.replay_words(lc, (1,))[8:10] == [1, -1]
    assert launcher._DYNAMIC.size + n * 8 <= 512  # replay.cpp's parameter buffer


def test_the_words_format_is_the_one_replay_cpp_reads():
    source = (replay.resources.files("ports.fastrope") / replay.SOURCE).read_text()
    assert f"constexpr int64_t kFormat = {run.REPLAY_FORMAT};" in source
    assert f"kDynamicBytes = {launcher._DYNAMIC.size // 8} * sizeof(uint64_t)" in source
