"""The SGLang port on the CPU: launch-shape choice, kernel list, host refusals (each raised
before any launch: inputs that pass every check reach the device check, which fails here on CPU
tensors), and the registry rows' reasons."""
from __future__ import annotations

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
