"""The SGLang port on the CPU: launch-shape choice, kernel list, host refusals (each raised
before any launch: inputs that pass every check reach the device check, which fails here on CPU
tensors), the host range checks and the flags that skip them, the row bounds the launch passes
to the kernels, and the registry rows (their reasons; the cache row checks positions once in
prepare and times the call without the sync)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ports import registry, sglang
from ports.sglang import _launch
from reference.case import RopeCase

NNZ, HQ, HK, D = 6, 4, 2, 128


def rand(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape) + 0.5).to(dtype)


def cache(rows=16, r=D) -> torch.Tensor:
    return rand(rows, r, dtype=torch.float32)


def qk(d=D, dtype=torch.bfloat16):
    return rand(NNZ, HQ * d, dtype=dtype), rand(NNZ, HK * d, dtype=dtype)


def pos(high=16, n=NNZ) -> torch.Tensor:
    return torch.randint(0, high, (n,))


@pytest.mark.parametrize("head_dim, elem, want", [
    (64, 2, (8, 8, 16)), (128, 2, (8, 16, 8)), (256, 2, (8, 32, 4)), (512, 2, (16, 32, 4))])
def test_vector_layout_is_flashinfers(head_dim, elem, want):
    # vec_size = max(16 / sizeof(T), head_dim / 32), bdx = head_dim / vec, bdy = max(128, bdx)/bdx
    assert _launch.vector_layout(head_dim, elem) == want


def test_head_parallel_below_one_wave():
    # 132 SMs x 8 blocks = 1056 blocks; bdy = 8 tokens per block
    assert _launch.use_head_parallel(1, 8, 8, 132)
    assert _launch.use_head_parallel(1055 * 8, 8, 8, 132)
    assert not _launch.use_head_parallel(1056 * 8, 8, 8, 132)
    assert not _launch.use_head_parallel(1056 * 8 - 7, 8, 8, 132)  # rounds up to 1056 blocks


def test_every_launchable_instantiation_is_compiled():
    flags = (False, True)
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in _launch.HEAD_DIMS:
            for a in flags:
                for b in flags:
                    for c in flags:
                        name = _launch.cache_kernel_name(a, b, c, head_dim, dtype)
                        assert name in _launch.MODULE.kernels
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for neox in flags:
            assert _launch.any_head_kernel_name(neox, dtype) in _launch.MODULE.kernels
    assert len(_launch.MODULE.kernels) == 2 * 4 * 8 + 6


def test_valid_input_passes_every_host_check():
    q, k = qk()
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        sglang.apply_rope_with_cos_sin_cache_inplace(pos(), q, k, D, cache())
    kv = sglang.FusedSetKVBufferArg(rand(NNZ, HK * D), rand(20, HK * D), rand(20, HK * D),
                                    None, None, torch.randperm(20)[:NNZ])
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        sglang.apply_rope_with_cos_sin_cache_inplace(pos(), q, k, D, cache(), False, kv)


def _fused(**over):
    base = dict(value=rand(NNZ, HK * D), k_buffer=rand(20, HK * D), v_buffer=rand(20, HK * D),
                k_scale=None, v_scale=None, cache_loc=torch.randperm(20)[:NNZ])
    base.update(over)
    return sglang.FusedSetKVBufferArg(**base)


@pytest.mark.parametrize("make, error, match", [
    (lambda: dict(cos_sin_cache=cache().half()), ValueError, "should be float32"),
    (lambda: dict(query=qk(80)[0], key=qk(80)[1], head_size=80, cos_sin_cache=cache(r=80)),
     NotImplementedError, "rotary_embedding"),
    (lambda: dict(positions=pos(high=40)), ValueError, r"pos_ids must lie in \[0, 16\)"),
    (lambda: dict(positions=torch.full((NNZ,), -1)), ValueError, "pos_ids must lie"),
    (lambda: dict(enable_pdl=True), ValueError, "enable_pdl needs the fused"),
    (lambda: dict(cos_sin_cache=cache(r=24)), NotImplementedError, "multiple of 16"),
    (lambda: dict(cos_sin_cache=cache(r=136)), ValueError, "<= head_dim"),
    (lambda: dict(query=qk(dtype=torch.float32)[0], key=qk(dtype=torch.float32)[1]),
     TypeError, "float16 and bfloat16"),
    (lambda: dict(key=qk(dtype=torch.float16)[1]), TypeError, "one dtype"),
    (lambda: dict(query=rand(NNZ * HQ * D + 1)[1:].view(NNZ, HQ * D)), ValueError, "aligned"),
    (lambda: dict(positions=pos(n=NNZ - 1)), ValueError, "pos_ids must be"),
    (lambda: dict(fused_set_kv_buffer_arg=_fused(k_scale=1.0)), NotImplementedError, "k_scale"),
    (lambda: dict(fused_set_kv_buffer_arg=_fused(cache_loc=torch.arange(NNZ, dtype=torch.int32))),
     TypeError, "int64"),
    (lambda: dict(fused_set_kv_buffer_arg=_fused(cache_loc=torch.arange(NNZ) + 15)),
     ValueError, r"kv_cache_loc must lie in \[0, 20\)"),
    (lambda: dict(fused_set_kv_buffer_arg=_fused(value=rand(NNZ, 3 * D))), ValueError, "v must be"),
    (lambda: dict(fused_set_kv_buffer_arg=_fused(k_buffer=rand(20, HK * D, dtype=torch.float16))),
     TypeError, "one dtype"),
])
def test_cache_path_refusals(make, error, match):
    q, k = qk()
    kw = dict(positions=pos(), query=q, key=k, head_size=D, cos_sin_cache=cache())
    kw.update(make())
    with pytest.raises(error, match=match):
        sglang.apply_rope_with_cos_sin_cache_inplace(**kw)


def test_interleaved_takes_a_rotary_width_of_one_vector():
    q, k = qk()
    with pytest.raises(ValueError, match="must be a CUDA tensor"):  # 24 = 3 x 8: fine
        sglang.apply_rope_with_cos_sin_cache_inplace(pos(), q, k, D, cache(r=24), is_neox=False)


def any_head(d=80, dtype=torch.float16):
    return rand(NNZ, 16 * d, dtype=dtype), rand(NNZ, 16 * d, dtype=dtype)


@pytest.mark.parametrize("is_neox, width", [(True, 40), (False, 80), (True, 20), (False, 40)])
def test_any_head_size_valid_inputs_reach_the_device(is_neox, width):
    q, k = any_head()
    cs = rand(NNZ, width, dtype=torch.float16)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        sglang.rotary_embedding(cs, cs.clone(), q, k, 80, is_neox)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        sglang.rotary_embedding(cs, cs.clone(), q, None, 80, is_neox)


@pytest.mark.parametrize("make, error, match", [
    (lambda q, k, c: (rand(NNZ, 41, dtype=torch.float16), rand(NNZ, 41, dtype=torch.float16), q,
                      k, 80, True), ValueError, "must be even and <= "),
    (lambda q, k, c: (rand(NNZ, 81, dtype=torch.float16), rand(NNZ, 81, dtype=torch.float16), q,
                      k, 80, False), ValueError, "must be even and <= "),
    (lambda q, k, c: (c.float(), c.float(), q, k, 80, True), TypeError, "cos/sin dtype"),
    (lambda q, k, c: (c, c, q.view(NNZ, 16, 80)[:, ::2], None, 80, True), ValueError,
     "query must be contiguous"),
    (lambda q, k, c: (c, c, q, rand(NNZ, 3 * 80, dtype=torch.float16), 80, True), ValueError, "divisible by num_kv_heads"),
    (lambda q, k, c: (c, c, q, k, 96, True), ValueError, "not divisible by head_size"),
    (lambda q, k, c: (c[:-1], c[:-1], q, k, 80, True), ValueError, "rows for"),
    (lambda q, k, c: (c, c, q.double(), k.double(), 80, True), TypeError, "cos/sin dtype"),
    (lambda q, k, c: (c.t().contiguous().t(), c, q, k, 80, True), ValueError, "contiguous"),
])
def test_any_head_size_refusals(make, error, match):
    q, k = any_head()
    c = rand(NNZ, 40, dtype=torch.float16)
    with pytest.raises(error, match=match):
        sglang.rotary_embedding(*make(q, k, c))


def test_registry_rows_and_their_reasons():
    cache_row = registry.get("sglang.cos_sin_cache_inplace")
    any_row = registry.get("sglang.rotary_embedding")
    h80 = RopeCase(1, 64, 16, 80, kv_heads=16, dtype="bf16", style="interleaved",
                   cos_sin_dtype="same")
    assert "rotary_embedding takes any head size" in cache_row.unsupported_reason(h80)
    assert any_row.unsupported_reason(h80) is None
    gqa = RopeCase(2, 64, 32, 128, kv_heads=8, dtype="bf16")
    assert cache_row.unsupported_reason(gqa) is None
    assert cache_row.unsupported_reason(gqa.replace(cos_sin_dtype="same")) is None
    assert "x's dtype" in any_row.unsupported_reason(gqa)
    assert "multiple of 16" in cache_row.unsupported_reason(gqa.replace(rotary_dim=40))
    assert cache_row.unsupported_reason(gqa.replace(style="interleaved", rotary_dim=40)) is None
    assert "needs a k" in cache_row.unsupported_reason(gqa.replace(kv_heads=None))
    assert any_row.unsupported_reason(h80.replace(kv_heads=None)) is None
    assert "asymmetric" in any_row.unsupported_reason(h80.replace(asymmetric=True))
    assert any_row.unsupported_reason(h80.replace(asymmetric=True, style="rotate_half")) is None
    assert any_row.unsupported_reason(h80.replace(contiguous=False)) == "needs contiguous input"


def test_host_index_checks_can_be_skipped():
    """The ranges of positions and cache_loc are read on the host (a sync the original does not
    have) unless the caller skips them, each by its own flag: the bad index then reaches the
    device check, not the range check (on a GPU the kernels' own bounds take it)."""
    q, k = qk()
    bad_pos, bad_loc = pos().index_fill(0, torch.tensor([2]), 16), torch.arange(NNZ) + 15
    call = sglang.apply_rope_with_cos_sin_cache_inplace
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        call(bad_pos, q, k, D, cache(), check_positions_on_host=False)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        call(bad_pos, q, k, D, cache(), False, _fused(cache_loc=bad_loc),
             check_positions_on_host=False, check_cache_loc_on_host=False)
    with pytest.raises(ValueError, match="pos_ids must lie"):
        call(bad_pos, q, k, D, cache(), False, _fused(), check_cache_loc_on_host=False)
    with pytest.raises(ValueError, match="kv_cache_loc must lie"):
        call(pos(), q, k, D, cache(), False, _fused(cache_loc=bad_loc),
             check_positions_on_host=False)


def test_index_checks_name_the_range():
    sglang.check_positions(torch.tensor([0, 15]), 16)
    sglang.check_positions(torch.zeros(0, dtype=torch.int64), 16)
    sglang.check_cache_loc(torch.tensor([19, 0]), 20)
    for bad in ([0, 16], [-1, 3]):
        with pytest.raises(ValueError, match=r"pos_ids must lie in \[0, 16\).*\[-?\d+, \d+\]"):
            sglang.check_positions(torch.tensor(bad), 16)
        with pytest.raises(ValueError, match=r"kv_cache_loc must lie in \[0, 15\)"):
            sglang.check_cache_loc(torch.tensor(bad), 15)


def test_cache_loc_is_checked_against_the_smaller_buffer():
    q, k = qk()
    loc = torch.arange(NNZ) + 14  # rows 14..19: inside k_buffer's 20 rows, past v_buffer's 18
    with pytest.raises(ValueError, match=r"kv_cache_loc must lie in \[0, 18\)"):
        sglang.apply_rope_with_cos_sin_cache_inplace(
            pos(), q, k, D, cache(), False, _fused(v_buffer=rand(18, HK * D), cache_loc=loc))


def _kernel_params() -> list[str]:
    """The cache kernels' parameter names, in order, from rope.cu's SGL_ROPE_PARAMS."""
    import re
    from pathlib import Path

    src = (Path(_launch.__file__).parent / "rope.cu").read_text()
    body = re.search(r"#define SGL_ROPE_PARAMS(.*?)\n\n", src, re.S).group(1).replace("\\", " ")
    return [re.findall(r"\w+", p)[-1] for p in body.split(",")]


@pytest.mark.parametrize("fused", [False, True])
def test_the_launch_passes_the_row_bounds_the_kernel_reads(monkeypatch, fused):
    """The kernel's bounds come as arguments: the cache's rows as max_pos and the rows both KV
    buffers have as kv_rows (0 without the fused store), one argument per parameter of the
    kernel's signature. The launch is captured here instead of run."""
    launched = []
    monkeypatch.setattr(_launch._cupy, "check_cuda", lambda *named: 0)
    monkeypatch.setattr(_launch, "occupancy", lambda *a: 8)
    monkeypatch.setattr(_launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(_launch._cupy, "launch", lambda *a: launched.append(a))
    q, k = qk()
    kv = _fused(v_buffer=rand(18, HK * D), cache_loc=torch.arange(NNZ)) if fused else None
    sglang.apply_rope_with_cos_sin_cache_inplace(pos(), q, k, D, cache(rows=16), False, kv)
    (_, name, _, _, _, args), = launched
    params = _kernel_params()
    assert name.startswith("sgl_rope_enhanced") and len(args) == len(params)
    bound = dict(zip(params, args))
    assert bound["max_pos"] == 16 and bound["max_pos"].dtype == np.int64
    assert bound["kv_rows"] == (18 if fused else 0) and bound["kv_rows"].dtype == np.int64
    assert bound["nnz"] == NNZ and bound["rotary_dim"] == D


def test_registry_row_checks_positions_once_and_times_the_original_work(monkeypatch):
    """The cache row reads the positions' range once while building its call; the timed call
    skips the port's sync (``check_positions_on_host=False``), as the original has none."""
    from reference.case import make_inputs

    case = RopeCase(2, 8, 4, 64, kv_heads=2, dtype="bf16")
    calls, checked = [], []
    monkeypatch.setattr(sglang, "apply_rope_with_cos_sin_cache_inplace",
                        lambda *a, **kw: calls.append(kw))
    real = sglang.check_positions
    monkeypatch.setattr(sglang, "check_positions", lambda *a: checked.append(a) or real(*a))
    fn = registry.get("sglang.cos_sin_cache_inplace").prepare(case, make_inputs(case, 0))
    assert len(checked) == 1  # once, while preparing
    fn()
    fn()
    assert len(checked) == 1
    assert [kw["check_positions_on_host"] for kw in calls] == [False, False]
