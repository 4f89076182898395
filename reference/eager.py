"""The seeds' eager PyTorch baselines, each written as its original writes it.

* :func:`hf_apply_rotary_pos_emb`: Hugging Face Llama's ``rotate_half`` form (rotate-half
  convention): the baseline of the rotate-half rows' speed-up column.
* :func:`llama_apply_rotary_emb`: Meta-Llama's complex-number form (interleaved; seed 004): the
  baseline of the interleaved rows.
* :func:`llama_apply_rotary_emb_real`: kernl's real-arithmetic rewrite of it (seed 004).
* :class:`RotaryPositionalEmbeddings`: the torchtune module with a cached table and
  ``input_pos`` (seed 003; interleaved).
* :func:`leetcuda_naive_rope`: LeetCUDA's torch reference (seed 001).

They are rows too (family ``eager``): :mod:`ports.eager` names each upstream and lists the
departures, all of which leave the arithmetic alone.
"""
from __future__ import annotations

import torch
from torch import nn


# ---- Hugging Face (transformers.models.llama.modeling_llama) -----------------------------------
def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input: ``[-x2, x1]``."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor,
                            sin: torch.Tensor, unsqueeze_dim: int = 1):
    """``q * cos + rotate_half(q) * sin`` (and k); cos/sin ``[b, s, d]`` get a head axis at
    ``unsqueeze_dim`` (1 for ``[b, h, s, d]`` inputs, 2 for ``[b, s, h, d]``)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (hf_rotate_half(q) * sin)
    k_embed = None if k is None else (k * cos) + (hf_rotate_half(k) * sin)
    return q_embed, k_embed


# ---- Meta-Llama (llama/model.py), complex form --------------------------------------------------
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    if freqs_cis.shape != (x.shape[1], x.shape[-1]):
        raise ValueError(f"freqs_cis {tuple(freqs_cis.shape)} must be (seqlen, head_dim/2) = "
                         f"{(x.shape[1], x.shape[-1])}")
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def llama_apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor | None, freqs_cis: torch.Tensor):
    """x ``[b, s, h, d]`` as complex pairs times ``freqs_cis`` ``[s, d/2]`` (complex64)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    if xk is None:
        return xq_out.type_as(xq), None
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


# ---- kernl's rewrite without complex numbers (seed 004) -----------------------------------------
def precompute_freqs_cis_pytorch(dim: int, end: int, theta: float = 10000.0,
                                 device: torch.device | str | None = None):
    if dim % 2:
        raise ValueError(f"dim must be even, got {dim}")
    sequence = torch.arange(0, dim, 2, dtype=torch.float32, device=device)
    freqs = 1.0 / (theta ** (sequence / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = t[:, None] * freqs[None, :]
    return torch.cos(freqs), torch.sin(freqs)


def llama_apply_rotary_emb_real(x: torch.Tensor, freq_cos: torch.Tensor, freq_sin: torch.Tensor
                                ) -> torch.Tensor:
    x_real = x[..., 0::2]
    x_imag = x[..., 1::2]
    freq_cos = reshape_for_broadcast(freq_cos, x_real).to(torch.float32)
    freq_sin = reshape_for_broadcast(freq_sin, x_imag).to(torch.float32)
    x_out_real = x_real * freq_cos - x_imag * freq_sin
    x_out_imag = x_real * freq_sin + x_imag * freq_cos
    x_out = torch.stack((x_out_real, x_out_imag), dim=-1).flatten(-2)
    return x_out.type_as(x)


# ---- torchtune (torchtune/modules/position_embeddings.py, as seed 003 quotes it) --------------
class RotaryPositionalEmbeddings(nn.Module):
    """Interleaved RoPE with a cache of ``max_seq_len`` rows built at init (fp32)."""

    def __init__(self, dim: int, max_seq_len: int = 4096, base: int = 10_000) -> None:
        super().__init__()
        self.dim = dim
        self.base = base
        self.max_seq_len = max_seq_len
        self._rope_init()

    def reset_parameters(self) -> None:
        self._rope_init()

    def _rope_init(self) -> None:
        theta = 1.0 / (self.base ** (torch.arange(0, self.dim, 2)[: (self.dim // 2)].float()
                                     / self.dim))
        self.register_buffer("theta", theta, persistent=False)
        self.build_rope_cache(self.max_seq_len)

    def build_rope_cache(self, max_seq_len: int = 4096) -> None:
        seq_idx = torch.arange(max_seq_len, dtype=self.theta.dtype, device=self.theta.device)
        idx_theta = torch.einsum("i, j -> ij", seq_idx, self.theta).float()
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[b, s, n_h, h_d]``; ``input_pos`` ``[s]`` positions shared by the batch."""
        seq_len = x.size(1)
        rope_cache = self.cache[:seq_len] if input_pos is None else self.cache[input_pos]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack(
            [
                xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
            ],
            -1,
        )
        x_out = x_out.flatten(3)
        return x_out.type_as(x)


# ---- LeetCUDA's torch reference (kernels/rope/rope.py, seed 001's "f32_th" row) --------------
def leetcuda_naive_rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x ``[seq_len, dim]``: complex pairs times a table built *on the CPU in every call* and
    copied to x's device, as upstream's benchmark does (upstream calls ``.cuda()``; this uses
    ``.to(x.device)`` so it also runs on the CPU)."""
    dim = x.shape[-1]
    seq_len = x.shape[-2]
    x_ = x.float().reshape(*x.shape[:-1], -1, 2)
    x_ = torch.view_as_complex(x_)
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs).float().to(x.device)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    xq_out = torch.view_as_real(x_ * freqs_cis).flatten(1)
    return xq_out.type_as(x)
