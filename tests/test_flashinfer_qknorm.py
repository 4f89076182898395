"""The FlashInfer ``fused_qk_rmsnorm_rope`` port's host side on the CPU: the original's checks and
the port's added ones (each a named exception before any launch), the frequency table, the
kernel list; and the float64 oracle of the across-heads norm it computes (reference/qk_norm.py's
``norm="token"``), checked by hand. The kernel compiles for sm_90 in tests/test_compile_cuda.py
and runs against the oracle in tests/test_gpu_flashinfer_qknorm.py."""
from __future__ import annotations

import math

import pytest
import torch

from ports import flashinfer_port
from ports.flashinfer_port import _qknorm_launch as L
from reference.qk_norm import qk_norm_rope_oracle, rms_norm

T, HQ, HK, HV, D = 6, 4, 2, 2, 128
BF16 = torch.bfloat16
ONE_D = dict(ppf=T, pph=1, ppw=1, num_frame_channels=D, num_height_channels=0,
             num_width_channels=0)


def _call(qkv=None, qw=None, kw=None, **kw_):
    qkv = torch.randn(T, (HQ + HK + HV) * D, dtype=BF16) if qkv is None else qkv
    qw = torch.randn(HQ * D, dtype=BF16) if qw is None else qw
    kw = torch.randn(HK * D, dtype=BF16) if kw is None else kw
    args = dict(ONE_D, num_heads_q=HQ, num_heads_k=HK, num_heads_v=HV, head_dim=D)
    args.update(kw_)
    return lambda: flashinfer_port.fused_qk_rmsnorm_rope(qkv, qw, kw, **args)


BAD = {
    "fp16 qkv": (_call(qkv=torch.randn(T, (HQ + HK + HV) * D, dtype=torch.float16)), TypeError,
                 "bfloat16"),
    "strided qkv": (_call(qkv=torch.randn(T, 2 * (HQ + HK + HV) * D, dtype=BF16)[:, ::2]),
                    ValueError, "contiguous"),
    "4-D qkv": (_call(qkv=torch.randn(1, T, HQ + HK + HV, D, dtype=BF16)), ValueError, "2-D"),
    "head_dim 96": (_call(head_dim=96), ValueError, "64, 128 or 256"),
    "33 heads": (_call(num_heads_q=33), ValueError, "<= 32"),
    "channels sum": (_call(num_frame_channels=64), ValueError, "must equal head_dim"),
    "odd channels": (_call(num_frame_channels=63, num_height_channels=65), ValueError, "even"),
    "ppw 0": (_call(ppw=0), ValueError, "positive"),
    "3-D seq_len": (_call(qkv=torch.randn(1, T, (HQ + HK + HV) * D, dtype=BF16), ppf=T - 1),
                    ValueError, "seq_len"),
    "tokens not a multiple": (_call(ppf=4), ValueError, "divisible"),
    "row size": (_call(num_heads_v=1), ValueError, "last dim"),
    "weight size": (_call(qw=torch.randn(D, dtype=BF16)), ValueError, "q_weight has 128"),
    "weight dtype": (_call(kw=torch.randn(HK * D)), TypeError, "bfloat16"),
    "q_out shape": (_call(q_out=torch.empty(T, HQ, 64, dtype=BF16)), ValueError, "q_out shape"),
    "q_out dtype": (_call(q_out=torch.empty(T, HQ, D)), TypeError, "q_out dtype"),
    "attention factor without yarn": (_call(attention_factor=2.0), ValueError,
                                      "attention_factor must be 1.0"),
    "heads not int": (_call(num_heads_q=4.0), TypeError, "num_heads_q must be an int"),
    "eps not a number": (_call(eps="1e-6"), TypeError, "eps must be a number"),
    "cpu tensors": (_call(), ValueError, "CUDA tensor"),
    "cpu tensors, 3-D, fp8, yarn": (_call(qkv=torch.randn(2, T, (HQ + HK + HV) * D, dtype=BF16),
                                          output_fp8=True, factor=4.0, attention_factor=1.2),
                                    ValueError, "CUDA tensor"),
}


@pytest.mark.parametrize("name", BAD)
def test_refusals_are_named_exceptions(name):
    call, exc, words = BAD[name]
    with pytest.raises(exc, match=words):
        call()


def test_outputs_overlapping_qkv_are_refused():
    qkv = torch.randn(T, (HQ + HK + HV) * D, dtype=BF16)
    q_out = qkv[:, : HQ * D].view(T, HQ, D)  # not contiguous: refused as such
    with pytest.raises(ValueError, match="contiguous"):
        _call(qkv=qkv, q_out=q_out)()
    flat = torch.empty(2 * T * (HQ + HK + HV) * D, dtype=BF16)
    qkv2 = flat[: T * (HQ + HK + HV) * D].view(T, -1)
    with pytest.raises(ValueError, match="overlaps qkv"):
        _call(qkv=qkv2, q_out=flat[:T * HQ * D].view(T, HQ, D))()


def test_empty_input_returns_the_outputs():
    q, k, v = _call(qkv=torch.randn(0, (HQ + HK + HV) * D, dtype=BF16))()
    assert q.shape == (0, HQ, D) and k.shape == (0, HK, D) and v.shape == (0, HV, D)


def test_frequency_table():
    table = L.freq_table(D, 10000.0, (D, 0, 0), 1.0, 0.0, 0.0)
    want = torch.tensor([10000.0 ** (-2 * i / D) for i in range(D // 2)], dtype=torch.float64)
    torch.testing.assert_close(torch.from_numpy(table).double(), want, rtol=3e-7, atol=0)
    # Three sections: each restarts at frequency 1 over its own channel count.
    t3 = L.freq_table(D, 10000.0, (64, 32, 32), 1.0, 0.0, 0.0)
    assert t3[0] == t3[32] == t3[48] == 1.0
    assert math.isclose(float(t3[33]), 10000.0 ** (-2 / 32), rel_tol=1e-6)
    # YaRN: below `low` the frequency is kept (extrapolation), above `high` divided by factor.
    y = L.freq_table(D, 10000.0, (D, 0, 0), 4.0, 8.0, 32.0)
    assert y[0] == table[0] and math.isclose(float(y[63]), float(table[63]) / 4, rel_tol=1e-6)


def test_every_instantiation_is_compiled():
    assert len(L.MODULE.kernels) == 3 * 2 * 2 * 2
    assert L.kernel_name(128, False, False, False) in L.MODULE.kernels
    assert L.MODULE.options == ("--use_fast_math",)


def test_token_norm_oracle_by_hand():
    """Two heads of 2 channels, x = (1, 2 | 3, 4): mean square over the token 30 / 4; with one
    head per token the token norm is the head norm."""
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]], dtype=torch.float64)  # [1, 1, 2, 2]
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    r = (30 / 4) ** -0.5
    got = rms_norm(x, w, 0.0, norm="token")
    torch.testing.assert_close(got.flatten(), torch.tensor([1, 4, 9, 16.0],
                                                           dtype=torch.float64) * r)
    one = torch.randn(2, 3, 1, 8, dtype=torch.float64)
    w8 = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(one, w8, 1e-6, norm="token"), rms_norm(one, w8, 1e-6))
    bhsd = x.permute(0, 2, 1, 3)  # heads on axis 1
    torch.testing.assert_close(rms_norm(bhsd, w, 0.0, norm="token", layout="bhsd"),
                               got.permute(0, 2, 1, 3))
    cos = torch.ones(1, 2, dtype=torch.float64)
    y = qk_norm_rope_oracle(x, w, 0.0, cos, torch.zeros(1, 2, dtype=torch.float64),
                            torch.zeros(1, 1, dtype=torch.long), layout="bshd",
                            style="rotate_half", norm="token")
    torch.testing.assert_close(y, got)
    with pytest.raises(ValueError, match="unknown norm"):
        rms_norm(x, w, 0.0, norm="tokens")
