"""The FlashInfer port on the CPU: launch shape and strategy choice (pure Python, fake device
numbers), the fp32 launch parameters, argument validation (every refusal raised before any
launch), and the registry rows. The kernels compile for sm_90 in tests/test_compile_cuda.py (its
module list finds the port's three CudaModules)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ports import flashinfer_port as fi
from ports import registry
from ports.flashinfer_port import _launch
from reference import llama31_inv_freq
from reference.case import RopeCase


# ---- launch shape -----------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim, vec_size, bdx, bdy", [
    (64, 8, 8, 16), (128, 8, 16, 8), (256, 8, 32, 4), (512, 16, 32, 4)])
def test_vector_layout_16_bit(head_dim, vec_size, bdx, bdy):
    """vec_size = max(16 / 2, D / 32), bdx = D / vec_size, bdy = max(128, bdx) / bdx."""
    assert _launch.vector_layout(head_dim, 2) == (vec_size, bdx, bdy)


@pytest.mark.parametrize("nblks_x, per_sm, sms, want", [
    (132 * 16, 16, 132, "sequential"),        # exactly fills the resident slots
    (132 * 16 - 1, 16, 132, "head_parallel"),  # one block short
    (1, 16, 132, "head_parallel"),             # decode: one token tile
    (8192, 8, 132, "sequential"),              # long prefill
    (100, 1, 100, "sequential"), (99, 1, 100, "head_parallel"),
])
def test_strategy_choice(nblks_x, per_sm, sms, want):
    assert _launch.choose_strategy(nblks_x, per_sm, sms) == want


def test_strategy_on_fake_h100_for_published_shapes():
    """H100 SXM (132 SMs), head 128 bf16: bdy = 8 tokens per block; at 16 resident blocks per
    SM the switch sits at 2112 token tiles = 16896 tokens."""
    _, _, bdy = _launch.vector_layout(128, 2)
    tiles = lambda nnz: math.ceil(nnz / bdy)  # noqa: E731
    assert _launch.choose_strategy(tiles(1), 16, 132) == "head_parallel"          # decode b=1
    assert _launch.choose_strategy(tiles(1024), 16, 132) == "head_parallel"       # 1 x 1024
    assert _launch.choose_strategy(tiles(16896), 16, 132) == "sequential"
    assert _launch.choose_strategy(tiles(16888), 16, 132) == "head_parallel"  # 2111 tiles
    assert _launch.choose_strategy(tiles(128 * 1024), 16, 132) == "sequential"    # 128 x 1024


# ---- fp32 parameters --------------------------------------------------------------------------
def test_plain_rope_parameters():
    a, b, rcp_scale, rcp_theta = _launch.rope_parameters(1.0, 1e4)
    assert (a, b) == (0, 0) and rcp_scale == np.float32(1.0)
    assert rcp_theta == np.float32(1.0) / np.float32(1e4)
    assert all(isinstance(v, np.float32) for v in (a, b, rcp_scale, rcp_theta))


def test_llama31_parameters_give_the_reference_frequencies():
    """The kernel's blend with the launcher's (a, b), in float64, equals the reference's
    Llama 3.1 frequencies up to the fp32 rounding of a, b and 1/scale."""
    a, b, rcp_scale, rcp_theta = _launch.rope_parameters(8.0, 5e5, 1.0, 4.0, 8192.0)
    assert a == np.float32(8192.0 / (2 * math.pi * 4.0 - 2 * math.pi * 1.0))
    assert b == np.float32(-1.0 / 3.0)
    rot = 128
    j = np.arange(rot // 2, dtype=np.float64)
    freq = float(rcp_theta) ** (2 * j / rot)
    smooth = np.clip(freq * float(a) + float(b), 0, 1)
    blended = (1 - smooth) * freq * float(rcp_scale) + smooth * freq
    want = llama31_inv_freq(rot, 5e5, rope_scale=8.0).numpy()
    np.testing.assert_allclose(blended, want, rtol=2e-6)


@pytest.mark.parametrize("kw", [dict(rope_scale=0.0), dict(rope_theta=-1.0),
                                dict(rope_scale=float("inf"))])
def test_bad_rope_parameters_raise(kw):
    args = dict(rope_scale=1.0, rope_theta=1e4) | kw
    with pytest.raises(ValueError):
        _launch.rope_parameters(**args)


@pytest.mark.parametrize("low, high, old", [(4.0, 4.0, 8192), (0.0, 4.0, 8192), (1.0, 4.0, 0)])
def test_bad_llama31_factors_raise(low, high, old):
    with pytest.raises(ValueError, match="Llama 3.1"):
        _launch.rope_parameters(8.0, 5e5, low, high, old)


# ---- validation: every refusal before a launch (CPU tensors: the device check comes last) -----
def _qk(nnz=6, hq=4, hk=2, d=128, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(nnz, hq, d, generator=g).to(dtype),
            torch.randn(nnz, hk, d, generator=g).to(dtype))


def _pos(n=6, dtype=torch.int64):
    return torch.arange(n, dtype=dtype)


def _cache(rows=16, rot=128):
    return torch.randn(rows, rot)


def test_valid_cpu_inputs_reach_the_device_check():
    q, k = _qk()
    with pytest.raises(ValueError, match="CUDA tensor"):
        fi.apply_rope_pos_ids(q, k, _pos())
    with pytest.raises(ValueError, match="CUDA tensor"):
        fi.apply_rope(q, k, torch.tensor([0, 2, 6]), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="CUDA tensor"):
        fi.apply_rope_with_cos_sin_cache(_pos(), q.flatten(1), k.flatten(1), 128, _cache())
    with pytest.raises(ValueError, match="CUDA tensor"):  # q alone: k with 0 heads
        fi.apply_llama31_rope_pos_ids(q, k[:, :0], _pos())


def _refusals():
    q, k = _qk()
    q64, k64 = _qk(d=64)
    cases = {
        "fp32 q": (TypeError, lambda: fi.apply_rope_pos_ids(q.float(), k.float(), _pos())),
        "mixed dtypes": (TypeError, lambda: fi.apply_rope_pos_ids(q, k.bfloat16(), _pos())),
        "2-D q": (ValueError, lambda: fi.apply_rope_pos_ids(q[:, 0], k, _pos())),
        "token counts": (ValueError, lambda: fi.apply_rope_pos_ids(q, k[:5], _pos())),
        "head dims": (ValueError, lambda: fi.apply_rope_pos_ids(q, k64, _pos())),
        "head_dim 80": (NotImplementedError, lambda: fi.apply_rope_pos_ids(
            q[..., :80].contiguous(), k[..., :80].contiguous(), _pos())),
        "last dim strided": (ValueError, lambda: fi.apply_rope_pos_ids(
            q[..., ::2], k[..., ::2], _pos())),
        "rotary_dim > head_dim": (ValueError, lambda: fi.apply_rope_pos_ids(q, k, _pos(),
                                                                          rotary_dim=256)),
        "rotary_dim not whole vectors": (ValueError, lambda: fi.apply_rope_pos_ids(
            q, k, _pos(), rotary_dim=40)),
        "interleaved rotary_dim 4": (ValueError, lambda: fi.apply_rope_pos_ids(
            q, k, _pos(), rotary_dim=4, interleave=True)),
        "rotary_dim float": (TypeError, lambda: fi.apply_rope_pos_ids(q, k, _pos(),
                                                                    rotary_dim=64.0)),
        "short pos_ids": (ValueError, lambda: fi.apply_rope_pos_ids(q, k, _pos(5))),
        "float pos_ids": (TypeError, lambda: fi.apply_rope_pos_ids(q, k, _pos().float())),
        "misaligned q": (ValueError, lambda: fi.apply_rope_pos_ids(
            torch.empty(6 * 4 * 128 + 1, dtype=torch.float16)[1:].view(6, 4, 128), k, _pos())),
        "head stride not whole vectors": (ValueError, lambda: fi.apply_rope_pos_ids(
            torch.empty(6, 4, 132, dtype=torch.float16)[..., :128], k, _pos())),
        "theta 0": (ValueError, lambda: fi.apply_rope_pos_ids(q, k, _pos(), rope_theta=0.0)),
        "llama31 low == high": (ValueError, lambda: fi.apply_llama31_rope_pos_ids(
            q, k, _pos(), low_freq_factor=4.0)),
        "indptr falls": (ValueError, lambda: fi.apply_rope(
            q, k, torch.tensor([0, 4, 2, 6]), torch.zeros(3, dtype=torch.int64))),
        "indptr past nnz": (ValueError, lambda: fi.apply_rope_inplace(
            q, k, torch.tensor([0, 4, 7]), torch.zeros(2, dtype=torch.int64))),
        "indptr length": (ValueError, lambda: fi.apply_rope(
            q, k, torch.tensor([0, 6]), torch.zeros(2, dtype=torch.int64))),
        "indptr/offsets dtypes": (TypeError, lambda: fi.apply_llama31_rope(
            q, k, torch.tensor([0, 6]), torch.zeros(1, dtype=torch.int32))),
        "cache fp16": (ValueError, lambda: fi.apply_rope_with_cos_sin_cache(
            _pos(), q.flatten(1), k.flatten(1), 128, _cache().half())),
        "cache 3-D": (ValueError, lambda: fi.apply_rope_with_cos_sin_cache(
            _pos(), q.flatten(1), k.flatten(1), 128, _cache()[None])),
        "cache strided": (ValueError, lambda: fi.apply_rope_with_cos_sin_cache(
            _pos(), q.flatten(1), k.flatten(1), 128, torch.randn(128, 16).t())),
        "cache wider than head": (ValueError, lambda: fi.apply_rope_with_cos_sin_cache(
            _pos(), q64.flatten(1), k64.flatten(1), 64, _cache())),
        "position past the cache": (ValueError, lambda: fi.apply_rope_with_cos_sin_cache(
            torch.tensor([0, 1, 2, 3, 4, 16]), q.flatten(1), k.flatten(1), 128, _cache())),
        "negative position": (ValueError, lambda: fi.apply_rope_with_cos_sin_cache_inplace(
            torch.tensor([0, 1, 2, 3, 4, -1]), q.flatten(1), k.flatten(1), 128, _cache())),
        "head_size splits no heads": (ValueError, lambda: fi.apply_rope_with_cos_sin_cache(
            _pos(), q.flatten(1), k.flatten(1), 96, _cache())),
        "head_size 0": (ValueError, lambda: fi.apply_rope_with_cos_sin_cache(
            _pos(), q.flatten(1), k.flatten(1), 0, _cache())),
        "query not a tensor": (TypeError, lambda: fi.apply_rope_with_cos_sin_cache(
            _pos(), q.flatten(1).tolist(), k.flatten(1), 128, _cache())),
    }
    return cases


REFUSALS = _refusals()


@pytest.mark.parametrize("name", REFUSALS)
def test_refusal(name):
    exc, call = REFUSALS[name]
    with pytest.raises(exc) as info:
        call()
    assert "CUDA tensor" not in str(info.value)  # refused before the device check


def test_int32_positions_with_a_huge_cache_are_refused():
    """rows * rotary_dim past 2^32 overflows int32 positions' row offset (the shapes alone)."""
    _launch.check_row_offset(2**25, 128, torch.int32)  # last row at 2^32 - 128: fits
    with pytest.raises(NotImplementedError, match="int64 positions"):
        _launch.check_row_offset(2**25 + 1, 128, torch.int32)  # last row at 2^32
    _launch.check_row_offset(2**25 + 1, 128, torch.int64)


def test_host_index_checks_can_be_skipped():
    """The positions' range and indptr are read on the host (a sync the original does not have)
    unless the caller skips it: the bad index then reaches the device check, not the range
    check (on a GPU the kernels' own bounds take it)."""
    q, k = _qk()
    bad_positions = torch.tensor([0, 1, 2, 3, 4, 16])
    bad_indptr, offsets = torch.tensor([0, 4, 7]), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="CUDA tensor"):
        fi.apply_rope_with_cos_sin_cache(bad_positions, q.flatten(1), k.flatten(1), 128, _cache(),
                                         check_positions_on_host=False)
    with pytest.raises(ValueError, match="CUDA tensor"):
        fi.apply_rope_with_cos_sin_cache_inplace(bad_positions, q.flatten(1), k.flatten(1), 128,
                                                 _cache(), check_positions_on_host=False)
    for fn in (fi.apply_rope, fi.apply_rope_inplace, fi.apply_llama31_rope,
               fi.apply_llama31_rope_inplace):
        with pytest.raises(ValueError, match="CUDA tensor"):
            fn(q, k, bad_indptr, offsets, check_indptr_on_host=False)
        with pytest.raises(ValueError, match="must rise within"):
            fn(q, k, bad_indptr, offsets)


def test_index_checks_name_the_range():
    _launch.check_positions(torch.tensor([0, 15]), 16)
    _launch.check_positions(torch.zeros(0, dtype=torch.int64), 16)
    for bad in ([0, 16], [-1, 3]):
        with pytest.raises(ValueError, match=r"valid positions are 0\.\.15"):
            _launch.check_positions(torch.tensor(bad), 16)
    _launch.check_indptr(torch.tensor([0, 2, 2, 6]), 6)
    for bad in ([0, 4, 2, 6], [-1, 6], [0, 7]):
        with pytest.raises(ValueError, match=r"rise within \[0, nnz = 6\]"):
            _launch.check_indptr(torch.tensor(bad), 6)


# (row, the API function it calls, where q sits among that function's arguments, the flag, the
# check the row runs instead)
ROW_CHECKS = [
    ("flashinfer_port.cos_sin_cache", "apply_rope_with_cos_sin_cache", 1,
     "check_positions_on_host", "check_positions"),
    ("flashinfer_port.cos_sin_cache_inplace", "apply_rope_with_cos_sin_cache_inplace", 1,
     "check_positions_on_host", "check_positions"),
    ("flashinfer_port.apply_rope", "apply_rope", 0, "check_indptr_on_host", "check_indptr"),
    ("flashinfer_port.apply_rope_inplace", "apply_rope_inplace", 0, "check_indptr_on_host",
     "check_indptr"),
]


@pytest.mark.parametrize("name, api, q_arg, flag, check", ROW_CHECKS)
def test_rows_check_indices_once_and_time_the_original_work(monkeypatch, name, api, q_arg, flag,
                                                            check):
    """A row reads its indices once while building its call; the timed call passes the flag
    that skips the port's sync, so it does what the original does."""
    from reference.case import make_inputs

    case = RopeCase(2, 8, 4, 64, kv_heads=2, dtype="bf16")
    inputs = make_inputs(case, 0, torch.device("cpu"))
    calls, checked = [], []
    monkeypatch.setattr(fi, api, lambda *a, **kw: calls.append(kw) or a[q_arg:q_arg + 2])
    real = getattr(_launch, check)
    monkeypatch.setattr(f"ports.flashinfer_port.canonical.{check}",
                        lambda *a: checked.append(a) or real(*a))
    fn = registry.get(name).prepare(case, inputs)
    assert len(checked) == 1  # once, while preparing
    fn()
    fn()
    assert len(checked) == 1 and [kw[flag] for kw in calls] == [False, False]


# ---- registry ---------------------------------------------------------------------------------
def test_rows_are_registered_apart_from_the_peer():
    ports = [s for s in registry.select(["flashinfer_port"])]
    assert [s.name for s in ports] == [
        "flashinfer_port.apply_rope", "flashinfer_port.apply_rope_inplace",
        "flashinfer_port.pos_ids", "flashinfer_port.pos_ids_inplace",
        "flashinfer_port.cos_sin_cache", "flashinfer_port.cos_sin_cache_inplace"]
    assert all(s.kind == "port" and s.backend == "cupy" for s in ports)
    assert not {s.name for s in ports} & {s.name for s in registry.select(["flashinfer"])}


@pytest.mark.parametrize("case, reason", [
    (RopeCase(2, 8, 4, 80, dtype="bf16", kv_heads=2), "head_dim 80"),
    (RopeCase(2, 8, 4, 128, dtype="fp32", kv_heads=2), "dtype fp32"),
    (RopeCase(2, 8, 4, 128, dtype="bf16", kv_heads=2, rotary_dim=40), "multiple of 16"),
    (RopeCase(2, 8, 4, 128, dtype="bf16", kv_heads=2, with_v=True), "no v"),
])
def test_rows_say_why_not(case, reason):
    assert reason in registry.get("flashinfer_port.pos_ids").unsupported_reason(case)


def test_rows_take_q_alone_and_x_dtype_tables():
    case = RopeCase(1, 1, 32, 128, dtype="bf16", cos_sin_dtype="same")
    for name in ("flashinfer_port.pos_ids", "flashinfer_port.cos_sin_cache_inplace"):
        assert registry.get(name).unsupported_reason(case) is None


# ---- the kernels' index math, under a host emulation -------------------------------------------
def _host_cuda_include() -> str | None:
    """A CUDA include directory whose headers compile in host code (cuda_fp16.h needs crt/)."""
    import os

    from ports import _cupy

    for inc in [*_cupy.cuda_include_dirs(), "/usr/local/cuda/include"]:
        if os.path.isfile(os.path.join(inc, "crt", "host_defines.h")):
            return inc
    return None


def test_kernels_under_host_emulation(tmp_path):
    """tests/host_emulation/flashinfer_port.cpp runs every kernel of pos_enc.cu on the CPU (each
    block and thread in turn; head sizes 64 to 512, partial rotary, both conventions, GQA, token
    strides wider than the heads, per-token ids, three segments) against a float64 RoPE: one fp16
    rounding at most (outputs below 4: half an fp16 step is 2^-10), and no element unwritten."""
    import shutil
    import subprocess
    from pathlib import Path

    gxx, include = shutil.which("g++"), _host_cuda_include()
    if gxx is None or include is None:
        pytest.skip("needs g++ and CUDA headers usable in host code (crt/host_defines.h)")
    source = (Path(_launch.__file__).parent / "pos_enc.cu").read_text()
    for name in ("__sincosf", "__powf", "__int_as_float"):  # host stand-ins in the .cpp
        source = source.replace(name, "emu_" + name[2:])
    for line in ("typedef unsigned int uint32_t;", "typedef int int32_t;",
                 "typedef long long int64_t;"):
        source = source.replace(line, "")  # the host's <cstdint> has them
    kernel = tmp_path / "pos_enc_host.cu"
    kernel.write_text(source)
    binary = tmp_path / "emulate"
    harness = Path(__file__).parent / "host_emulation" / "flashinfer_port.cpp"
    build = subprocess.run([gxx, "-std=c++17", "-O1", f"-I{include}",
                            f'-DKERNEL_SOURCE="{kernel}"', str(harness), "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = [line.split() for line in run.stdout.splitlines()]
    assert len(lines) == 4 * 5 * 2  # head sizes x kernels x conventions
    for name, interleave, err, nans in lines:
        assert int(nans) == 0, f"{name} interleave={interleave}: {nans} elements unwritten"
        assert float(err) <= 2**-10 + 1e-6, f"{name} interleave={interleave}: error {err}"
