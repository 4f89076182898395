"""The FlashInfer ``fused_qk_rmsnorm_rope`` port on the GPU, against the float64 oracle of the
across-heads RMSNorm then RoPE (reference/qk_norm.py, ``norm="token"``).

The oracle's angles are the kernel's: ``fp32(pos * freq)`` with the port's fp32 frequency table,
each pair ``j`` at the position of the section holding channel ``2j``; its float64 cos/sin differ
from the kernel's ``__sincosf`` by at most the bound below. Tolerance, from the data: one bf16
rounding of the output, one of the normalised value (the kernel rounds it to bf16 before RoPE),
the fast sine/cosine's error times the largest normalised magnitude, and the fp32 steps.

1-D (the usual RoPE) and 3-D positions, NeoX and interleaved, GQA with fewer or more q heads
than k heads, 2-D and 3-D qkv, YaRN with an attention factor, RoPE alone, FP8 outputs with
scales, v copied bit-exact, outputs NaN-poisoned through preallocated buffers, qkv unchanged,
and a 32k-token Qwen3-8B-sized prefill.
"""
from __future__ import annotations

import math

import pytest
import torch

from ports import flashinfer_port
from ports.flashinfer_port import _qknorm_launch as L
from reference.oracle import rope_oracle
from reference.qk_norm import FP32_UNIT, fp32_steps, rms_norm
from reference.tables import expand_half
from reference.tolerances import ulp

pytestmark = pytest.mark.gpu

EPS = 1e-6
BF16 = torch.bfloat16


def sincos_error(max_angle: float) -> float:
    """Bound on ``__sincosf``'s absolute error up to ``max_angle`` radians: 2^-21.41 on
    [-pi, pi] (CUDA's documented bound), plus the range reduction's, taken as ``|x| 2^-20``."""
    return 2.0 ** -21.41 + max_angle * 2.0 ** -20


def _angles(tokens, seq, ppw, pphppw, channels, table, d):
    """[tokens, d/2] float64: pair j's angle, ``fp32(pos * freq[j])`` at the position of the
    section holding channel 2j (frame, height, width)."""
    i = torch.arange(tokens) % seq
    pos = torch.stack([i // pphppw, i % pphppw // ppw, i % ppw], -1)     # [T, 3]
    j = torch.arange(d // 2)
    section = (2 * j >= channels[0]).long() + (2 * j >= channels[0] + channels[1]).long()
    p = pos[:, section].float()                                          # [T, d/2]
    return (p * torch.from_numpy(table)[None, :]).double()               # one fp32 rounding


def run_and_check(t, hq, hk, hv, d, *, ppf, pph=1, ppw=1, channels=None, interleave=False,
                  factor=1.0, low=0.0, high=0.0, attention_factor=1.0, is_qk_norm=True,
                  output_fp8=False, scale=1.0, v_scale=1.0, batch_dim=False, seed=0):
    channels = channels or (d, 0, 0)
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + hk + hv) * d, generator=g) + 0.25).to(BF16).cuda()
    qw = (0.5 * torch.randn(hq * d, generator=g) + 1).to(BF16).cuda()
    kw = (0.5 * torch.randn(hk * d, generator=g) + 1).to(BF16).cuda()
    seq = ppf * pph * ppw
    x_in = qkv.view(t // seq, seq, -1) if batch_dim else qkv
    fp8 = torch.float8_e4m3fn
    out_dtype = fp8 if output_fp8 else BF16
    lead = (t // seq, seq) if batch_dim else (t,)
    outs = [torch.full((*lead, h, d), float("nan")).to(out_dtype).cuda() for h in (hq, hk, hv)]
    qkv0 = qkv.clone()
    q, k, v = flashinfer_port.fused_qk_rmsnorm_rope(
        x_in, qw, kw, ppf=ppf, pph=pph, ppw=ppw, num_frame_channels=channels[0],
        num_height_channels=channels[1], num_width_channels=channels[2], num_heads_q=hq,
        num_heads_k=hk, num_heads_v=hv, head_dim=d, eps=EPS, interleave=interleave,
        factor=factor, low=low, high=high, attention_factor=attention_factor,
        is_qk_norm=is_qk_norm, output_fp8=output_fp8, output_quant_scale=scale,
        v_quant_scale=v_scale, q_out=outs[0], k_out=outs[1], v_out=outs[2])
    assert q is outs[0] and k is outs[1] and v is outs[2]
    assert torch.equal(qkv, qkv0), "qkv changed"
    style = "interleaved" if interleave else "rotate_half"
    table = L.freq_table(d, 10000.0, channels, factor, low, high)
    ang = _angles(t, seq, ppw, pph * ppw, channels, table, d)
    cos, sin = expand_half(ang.cos(), style), expand_half(ang.sin(), style)
    rows = torch.arange(t)
    for name, out, lo, h, w in (("q", q, 0, hq, qw), ("k", k, hq, hk, kw)):
        x = qkv0[:, lo * d:(lo + h) * d].reshape(t, h, d).cpu()
        z = rms_norm(x, w.cpu(), EPS, norm="token") if is_qk_norm else x.double()
        ref = rope_oracle(z, cos, sin, rows, layout="thd", style=style) * attention_factor
        zmax = float(z.abs().max()) * attention_factor
        got = out.reshape(t, h, d).cpu().double()
        if output_fp8:
            got = got / scale
            top = float(ref.abs().max()) * scale
            out_ulp = 2.0 ** (math.floor(math.log2(top)) - 3) / scale  # e4m3: 3 mantissa bits
            mid = 0.0                                                  # no bf16 rounding then
        else:
            out_ulp = ulp(float(ref.abs().max()), BF16)
            mid = 2 * ulp(zmax, BF16) if is_qk_norm else 0.0
        tol = (out_ulp + mid + math.sqrt(2) * zmax * sincos_error(float(ang.abs().max()))
               + fp32_steps(h * d) * FP32_UNIT * zmax)
        assert not got.isnan().any(), f"{name}: NaN left in the output"
        err = float((got - ref).abs().max())
        assert err <= tol, f"{name}: max err {err:.3e} > tolerance {tol:.3e}"
    vin = qkv0[:, (hq + hk) * d:].reshape(*lead, hv, d)
    if output_fp8:
        torch.testing.assert_close(v.float(), (vin.float() * v_scale).to(fp8).float())
    else:
        assert torch.equal(v, vin), "v not copied bit-exact"


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_one_d_rope(interleave, d):
    run_and_check(2 * 300, 8, 4, 4, d, ppf=300, interleave=interleave)


@pytest.mark.parametrize("interleave", [False, True])
def test_three_d_positions(interleave):
    run_and_check(2 * 60, 6, 6, 6, 128, ppf=3, pph=4, ppw=5, channels=(64, 32, 32),
                  interleave=interleave, batch_dim=True, seed=1)


@pytest.mark.parametrize("heads", [(32, 8, 8), (4, 8, 2), (2, 2, 32)])
def test_head_counts(heads):
    run_and_check(64, *heads, 128, ppf=64, seed=2)


def test_yarn_attention_factor():
    run_and_check(256, 8, 8, 8, 128, ppf=256, factor=4.0, low=8.0, high=32.0,
                  attention_factor=1.25, seed=3)


def test_rope_alone():
    run_and_check(128, 8, 8, 8, 128, ppf=128, is_qk_norm=False, interleave=True, seed=4)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_outputs(d):
    run_and_check(96, 8, 4, 4, d, ppf=96, output_fp8=True, scale=2.0, v_scale=0.5, seed=5)


def test_32k_prefill_qwen3_8b_size():
    run_and_check(32768, 32, 8, 8, 128, ppf=32768, seed=6)
