"""Llama 3.1 frequency scaling in the reference (``reference.tables.llama31_inv_freq``), against
a direct float64 transcription of the Llama 3.1 definition in its branched form (the form
transformers writes as ``_compute_llama3_parameters``): per frequency, by wavelength."""
from __future__ import annotations

import math

import pytest
import torch

from reference import llama31_inv_freq
from reference.tables import inv_freq


def _llama3_direct(rotary_dim, base, factor, low, high, old_len):
    """Per-frequency Python floats: keep high frequencies, divide low ones by ``factor``,
    interpolate between by ``(old_len / wavelen - low) / (high - low)``."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for j in range(rotary_dim // 2):
        freq = 1.0 / base ** (2 * j / rotary_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("rotary_dim, base, factor, low, high, old_len", [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192.0),    # Llama 3.1 8B/70B/405B
    (64, 500000.0, 32.0, 1.0, 4.0, 8192.0),    # Llama 3.2 1B/3B (head 64, factor 32)
    (128, 10000.0, 4.0, 2.0, 8.0, 4096.0),     # other parameters: every branch still taken
    (256, 1e6, 16.0, 1.0, 4.0, 32768.0),
])
def test_matches_the_branched_definition(rotary_dim, base, factor, low, high, old_len):
    got = llama31_inv_freq(rotary_dim, base, rope_scale=factor, low_freq_factor=low,
                           high_freq_factor=high, old_context_len=old_len)
    want = _llama3_direct(rotary_dim, base, factor, low, high, old_len)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)


def test_every_branch_is_exercised():
    """The Llama 3.1 case keeps some frequencies, divides some by 8 and blends the rest: a
    test on these parameters cannot pass with one branch wrong."""
    plain = inv_freq(128, 500000.0)
    scaled = llama31_inv_freq(128)
    ratio = plain / scaled
    assert (ratio == 1).any() and (ratio == 8).any()
    assert ((ratio > 1) & (ratio < 8)).any()


def test_scale_one_is_plain_rope():
    torch.testing.assert_close(llama31_inv_freq(128, 10000.0, rope_scale=1.0),
                               inv_freq(128, 10000.0), rtol=1e-15, atol=0)


@pytest.mark.parametrize("kw", [dict(low_freq_factor=4.0, high_freq_factor=4.0),
                                dict(low_freq_factor=0.0), dict(rope_scale=0.0),
                                dict(old_context_len=-1.0)])
def test_bad_parameters_raise(kw):
    with pytest.raises(ValueError):
        llama31_inv_freq(128, **kw)
