"""The vLLM ``fused_qk_norm_rope`` port's host side on the CPU: the original's checks and the
port's added ones (each a named exception before any launch), the heads-per-warp choice and the
launch shapes, the kernel list. The kernels compile for sm_90 in tests/test_compile_cuda.py and
run against the float64 oracle in tests/test_gpu_vllm_qknorm.py."""
from __future__ import annotations

import pytest
import torch

from ports import vllm_port
from ports.vllm_port import _qknorm_launch as L

T, HQ, HK, HV, D = 5, 4, 2, 2, 128
BF16 = torch.bfloat16


def _cache(rows=16, rot=D, dtype=torch.float32):
    return torch.randn(rows, rot, dtype=dtype)


def _call(qkv=None, hq=HQ, hk=HK, hv=HV, d=D, eps=1e-6, qw=None, kw=None, cache=None,
          is_neox=True, pos=None, forced=-1):
    qkv = torch.randn(T, (HQ + HK + HV) * D, dtype=BF16) if qkv is None else qkv
    qw = torch.randn(D, dtype=BF16) if qw is None else qw
    kw = torch.randn(D, dtype=BF16) if kw is None else kw
    cache = _cache() if cache is None else cache
    pos = torch.arange(T) if pos is None else pos
    return lambda: vllm_port.fused_qk_norm_rope(qkv, hq, hk, hv, d, eps, qw, kw, cache, is_neox,
                                                pos, forced)


BAD = {
    "qkv strided": (_call(qkv=torch.randn(T, 2 * (HQ + HK + HV) * D, dtype=BF16)[:, ::2]),
                    ValueError, "qkv must be contiguous"),
    "positions int32": (_call(pos=torch.arange(T, dtype=torch.int32)), TypeError, "int64"),
    "qkv 3-D": (_call(qkv=torch.randn(T, HQ + HK + HV, D, dtype=BF16)), ValueError,
                "qkv must be 2-D"),
    "positions 2-D": (_call(pos=torch.zeros(1, T, dtype=torch.int64)), ValueError,
                      "position_ids must be 1-D"),
    "weight size": (_call(qw=torch.randn(64, dtype=BF16)), ValueError,
                    "q_weight has 64 elements"),
    "cache rank": (_call(cache=torch.randn(2, 16, D)), ValueError, "cos_sin_cache must be 2-D"),
    "odd rotary_dim": (_call(cache=_cache(rot=7)), ValueError, "even"),
    "rotary past head": (_call(cache=_cache(rot=2 * D)), ValueError, "exceeds head_dim"),
    "weight dtype": (_call(kw=torch.randn(D, dtype=torch.float16)), TypeError, "same dtype"),
    "token count": (_call(pos=torch.arange(T + 1)), ValueError, "position_ids has 6 tokens"),
    "row size": (_call(hv=1), ValueError, "qkv's row has"),
    "negative heads": (_call(hq=-1, hk=HK + 1 + HQ), ValueError, ">= 0"),
    "forced 3": (_call(forced=3), ValueError, "1, 2, 4 or 8"),
    "fp32 qkv": (_call(qkv=torch.randn(T, (HQ + HK + HV) * D), qw=torch.randn(D),
                       kw=torch.randn(D)), TypeError, "float16 and bfloat16 only"),
    "fp64 cache": (_call(cache=_cache(dtype=torch.float64)), TypeError, "cos_sin_cache"),
    "head_dim 96": (_call(qkv=torch.randn(T, (HQ + HK + HV) * 96, dtype=BF16), d=96,
                          qw=torch.randn(96, dtype=BF16), kw=torch.randn(96, dtype=BF16),
                          cache=_cache(rot=96)), NotImplementedError, "head_dim 96"),
    "rotary not a lane multiple": (_call(cache=_cache(rot=66), is_neox=False), ValueError,
                                   "multiple of head_dim / 32"),
    "neox partial": (_call(cache=_cache(rot=64)), NotImplementedError, "partial rotary"),
    "eps": (_call(eps=-1.0), ValueError, "eps"),
    "heads not int": (_call(hq=4.0), TypeError, "num_heads_q must be an int"),
    "cpu tensors": (_call(), ValueError, "CUDA tensor"),
    "cpu tensors, GPT-J partial": (_call(cache=_cache(rot=64), is_neox=False), ValueError,
                                   "CUDA tensor"),
}


@pytest.mark.parametrize("name", BAD)
def test_refusals_are_named_exceptions(name):
    call, exc, words = BAD[name]
    with pytest.raises(exc, match=words):
        call()


def test_heads_per_warp_follows_the_originals_sm90_thresholds():
    assert L.auto_heads_per_warp(10_000, 40, 128, 80) == 1          # not sm_90: always 1
    assert L.auto_heads_per_warp(255, 40, 128, 90) == 1             # 10200 units < 10240
    assert L.auto_heads_per_warp(256, 40, 128, 90) == 4             # 10240
    assert L.auto_heads_per_warp(1023, 40, 128, 90) == 4            # 40920 < 40960
    assert L.auto_heads_per_warp(1024, 40, 128, 90) == 8
    assert L.auto_heads_per_warp(100, 40, 256, 90) == 1             # 4000 < 4096
    assert L.auto_heads_per_warp(103, 40, 256, 90) == 2             # 4120
    assert L.auto_heads_per_warp(205, 40, 256, 90) == 4             # 8200


def test_launch_shapes():
    # One-head kernel: a warp per (token, head), 8 warps a block, no shared memory.
    assert L.launch_shape(3, 40, 128, 128, 4, 1) == (15, 1, 0)
    # Eight heads a warp: 5 chunks of 40 heads; cos/sin row (512 B fp32) + 8 tiles of 256 B.
    assert L.launch_shape(3, 40, 128, 128, 4, 8) == (2, 8, 8 * (512 + 8 * 256))
    # A cos/sin row of 2 * 36 = 72 bytes is not 16-byte pieces: back to the one-head kernel.
    assert L.launch_shape(3, 40, 64, 36, 2, 4) == (15, 1, 0)


def test_every_dispatched_instantiation_is_compiled():
    """Per qkv dtype: 3 cache dtypes x 3 head dims x 2 styles x 4 heads-per-warp."""
    assert set(L.MODULES) == {torch.float16, torch.bfloat16}
    assert all(len(m.kernels) == 3 * 3 * 2 * 4 for m in L.MODULES.values())
    bf16 = L.MODULES[torch.bfloat16].kernels
    assert L.kernel_name(torch.bfloat16, torch.float32, 128, False, 8) in bf16
    assert L.kernel_name(torch.float16, torch.bfloat16, 64, True, 1) in L.MODULE_FP16.kernels
