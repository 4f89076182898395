"""The float64 oracle of per-head QK-norm then RoPE, and the tolerances of a fused kernel for it.

Qwen3 and Gemma3 attention normalise each head of q and k with an RMSNorm whose learned weight
has ``head_dim`` elements, right before RoPE:

    x_hat = x * rsqrt(mean(x^2 over the head's D channels) + eps)
    z     = x_hat * w           (Gemma: x_hat * (1 + w))
    y     = RoPE(z)             (reference.oracle.apply_rope: first R channels rotated)

OLMo2 normalises q and k over all heads of a token instead (``norm="token"``: the mean is over
the token's ``heads * D`` channels and the weight has ``heads * D`` elements, ``[heads, D]``
here); the rotation is the same.

Everything here computes in float64. The backward is autograd on the same function, so it is
the exact transpose, whatever the cos/sin tables (their two members may differ).

Tolerances (:func:`forward_tolerance`, :func:`backward_tolerances`) are for kernels that compute
in fp32 and round once to the output dtype:

    tol = ulp(max|ref|, out dtype)  +  fp32_steps(D) * 2^-24 * scale

The first term is the one rounding at the store. The second bounds the fp32 arithmetic before
it, relative to ``scale``, the largest magnitude the fp32 math handles (``max|z|`` forward; the
two terms of the dx formula backward; ``sum |dz * x_hat|`` of each weight channel). It matters
for fp32 outputs only: for fp16/bf16 it is far below the first term.
"""
from __future__ import annotations

import math

import torch

from reference.oracle import rope_oracle
from reference.tolerances import ulp

F64 = torch.float64


NORMS = ("head", "token")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool = False,
             norm: str = "head", layout: str = "bshd") -> torch.Tensor:
    """float64 RMSNorm: ``x * rsqrt(mean(x^2) + eps) * w`` (``1 + w``: Gemma).

    ``norm="head"``: over the last dim, ``weight`` ``[D]``. ``norm="token"``: over each token's
    heads and channels together, ``weight`` ``[heads * D]`` (or ``[heads, D]``); ``layout`` says
    where the heads axis is.
    """
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; expected one of {NORMS}")
    x, w = x.to(F64), weight.to(F64)
    w = 1.0 + w if gemma else w
    if norm == "head":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    head_axis = 1 if layout == "bhsd" else x.dim() - 2
    xt = x.movedim(head_axis, -2)
    w = w.reshape(xt.shape[-2], xt.shape[-1])
    y = xt * torch.rsqrt(xt.pow(2).mean((-2, -1), keepdim=True) + eps) * w
    return y.movedim(-2, head_axis)


def qk_norm_rope_oracle(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        cos_table: torch.Tensor, sin_table: torch.Tensor,
                        positions: torch.Tensor, *, layout: str, style: str,
                        gemma: bool = False, norm: str = "head") -> torch.Tensor:
    """float64 RoPE of the RMSNorm of each head of ``x`` (any layout; ``norm="token"``: of each
    token's heads together, ``weight`` ``[heads * D]``).

    cos/sin are full-width tables ``[L, R]`` (R = rotary_dim, channels R..D-1 pass through after
    the norm); ``positions`` ``[B, S]`` (thd: ``[T]``) select their rows.
    """
    return rope_oracle(rms_norm(x, weight, eps, gemma=gemma, norm=norm, layout=layout),
                       cos_table, sin_table, positions, layout=layout, style=style)


def qk_norm_rope_oracle_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                                 eps: float, cos_table: torch.Tensor, sin_table: torch.Tensor,
                                 positions: torch.Tensor, *, layout: str, style: str,
                                 gemma: bool = False, norm: str = "head"
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(dx, dweight)`` of :func:`qk_norm_rope_oracle`, by autograd."""
    x64 = x.detach().to(F64).requires_grad_(True)
    w64 = weight.detach().to(F64).requires_grad_(True)
    y = qk_norm_rope_oracle(x64, w64, eps, cos_table, sin_table, positions, layout=layout,
                            style=style, gemma=gemma, norm=norm)
    dx, dw = torch.autograd.grad(y, (x64, w64), grad.to(F64))
    return dx, dw


# ---- tolerances ------------------------------------------------------------------------------
FP32_UNIT = 2.0 ** -24  # fp32 unit roundoff: one correctly rounded fp32 op errs by <= this


def fp32_steps(head_dim: int) -> float:
    """Relative error budget (in fp32 unit roundoffs) of the fp32 math of norm then rotation.

    * the sum of D squares: a tree of depth log2(D), <= 1 roundoff per level (relative to the sum),
      halved by the square root: ``log2(D) / 2``, doubled for margin: ``log2(D)``;
    * rsqrt: the GPU's approximate rsqrt errs by up to 2 ulp (4 roundoffs), plus the mean's
      division and eps's addition (2);
    * x * rstd * w: 2 roundings;
    * the rotation ``z1 c - z2 s``: 2 products and an add, each relative to the pair's magnitude
      (3), times sqrt(2) for the pair (<= 5);
    * backward adds the same again for the dx formula's two products, sum and difference (the
      caller doubles nothing: 8 more steps are included here for it).
    """
    return math.log2(max(head_dim, 2)) + 6 + 2 + 5 + 8


def forward_tolerance(ref: torch.Tensor, z: torch.Tensor, dtype: torch.dtype, head_dim: int
                      ) -> torch.Tensor:
    """Scalar tolerance (as a 0-d tensor) for a fused forward output ``ref`` (float64) in
    ``dtype``, whose normalised input before the rotation was ``z`` (float64)."""
    scale = float(z.abs().max()) if z.numel() else 0.0
    return torch.tensor(ulp(float(ref.abs().max()) if ref.numel() else 0.0, dtype)
                        + fp32_steps(head_dim) * FP32_UNIT * scale, dtype=F64, device=ref.device)


def backward_tolerances(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float,
                        cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                        *, layout: str, style: str, gemma: bool = False,
                        dx_dtype: torch.dtype, dw_dtype: torch.dtype, norm: str = "head"
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tolerances for ``(dx, dweight)``: a 0-d tensor for dx, a tensor of dweight's shape.

    ``norm="token"``: the mean runs over the token's heads and channels, and each of the
    ``heads * D`` weights sums over the tokens only.

    dx: ``rstd * (dx_hat - x_hat * mean(dx_hat * x_hat))``: the scale is the larger term,
    ``rstd * (|dx_hat| + |x_hat| * |mean|)``. dweight: a sum over N = tokens * heads of
    ``dz * x_hat``; its fp32 summation errs by at most ``(log2 N + 8)`` roundoffs of
    ``sum |dz * x_hat|`` for the tree and short sequential runs the kernel uses (doubled here).
    """
    d = x.shape[-1]
    x64, g64 = x.detach().to(F64), grad.detach().to(F64)
    x64 = x64.requires_grad_(True)
    head_axis = 1 if layout == "bhsd" else x.dim() - 2
    dims = (-1,) if norm == "head" else (head_axis, -1)
    width = d if norm == "head" else d * x.shape[head_axis]
    rstd = torch.rsqrt(x64.detach().pow(2).mean(dims, keepdim=True) + eps)
    x_hat = x64.detach() * rstd
    # dz = R(-theta) dy: the gradient of the rotation alone, by autograd on the oracle.
    z = x_hat.clone().requires_grad_(True)
    y = rope_oracle(z, cos_table, sin_table, positions, layout=layout, style=style)
    (dz,) = torch.autograd.grad(y, z, g64)
    w = weight.detach().to(F64)
    w = 1.0 + w if gemma else w
    if norm == "token":  # [heads, D], on the heads axis
        w = w.reshape(x.shape[head_axis], d)
        w = w[:, None, :] if layout == "bhsd" else w
    dx_hat = dz * w
    mean = (dx_hat * x_hat).mean(dims, keepdim=True)
    dx_scale = float((rstd * (dx_hat.abs() + x_hat.abs() * mean.abs())).max())
    dx_ref, dw_ref = qk_norm_rope_oracle_backward(
        x, weight, grad, eps, cos_table, sin_table, positions, layout=layout, style=style,
        gemma=gemma, norm=norm)
    dx_tol = torch.tensor(ulp(float(dx_ref.abs().max()), dx_dtype)
                          + fp32_steps(width) * FP32_UNIT * dx_scale, dtype=F64, device=x.device)
    terms = (dz * x_hat).abs()
    if norm == "token":  # [tokens, heads * D]
        terms = terms.movedim(head_axis, -2)
    terms = terms.reshape(-1, width)
    n = terms.shape[0]
    dw_abs = terms.sum(0)
    dw_tol = (ulp(float(dw_ref.abs().max()), dw_dtype)
              + 2 * (math.log2(max(n, 2)) + 8) * FP32_UNIT * dw_abs)
    return dx_tol, dw_tol


__all__ = ["NORMS", "rms_norm", "qk_norm_rope_oracle", "qk_norm_rope_oracle_backward",
           "fp32_steps", "forward_tolerance", "backward_tolerances"]
