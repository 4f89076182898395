"""Tolerances, all in one place, derived from the data.

An implementation passes when every element satisfies ``|out - ref| <= tol``, where ``ref`` is the
float64 oracle evaluated on the inputs the implementation actually consumed (see
:mod:`reference.expected`) and

    tol = steps * ulp(max|ref|, dtype)  +  angle_rel_err * |theta| * (|x_k| + |x_partner|)

* ``ulp(m, dtype)`` is the spacing of ``dtype`` at the data's largest magnitude ``m``: one rounding
  step of the output, measured on the data (the flash-attn idea, written as a spacing).
* ``steps`` counts how many such steps the design may legitimately lose. fp32 math with a single
  rounding at the store loses < 1 step in fp16/bf16 outputs; an fp32 output after a fused
  multiply-add of two products loses ~2 (DEFAULT_STEPS says why per dtype). Designs that round
  after every op (apex) or round tables to the storage dtype first (HF eager) declare more.
* The angle term covers kernels that compute angles themselves: an error of ``dtheta`` rotates a
  pair by ``dtheta``, moving each output by at most ``dtheta * (|x_k| + |x_p|)``;
  ``angle_rel_err`` is the relative angle error of the design (``dtheta / theta``).
"""
from __future__ import annotations

import math

import torch

MANTISSA_BITS: dict[torch.dtype, int] = {
    torch.float64: 52,
    torch.float32: 23,
    torch.float16: 10,
    torch.bfloat16: 7,
}

# Default rounding steps per output dtype for fp32 (or wider) arithmetic with one rounding at the
# store, on tables that were given to the kernel.
DEFAULT_STEPS: dict[str, float] = {
    "fp64": 4.0,  # fp64 math: a few ulps of fp64 (fma contraction vs. separate multiply/add)
    "fp32": 4.0,  # x*c + r*s in fp32: two products and an add, each <= 0.5 ulp, plus fma choice
    "fp16": 1.0,  # fp32 math is ~2^-13 below the fp16 step; the single store rounds <= 0.5 ulp
    "bf16": 1.0,  # same argument as fp16
}

# Relative angle error (dtheta / theta) of designs that compute angles in the kernel.
ANGLE_REL_ERR_FP32 = 4e-7       # powf/exp + product, each ~1 ulp of fp32 (2^-24 ~ 6e-8), x2 margin
# --use_fast_math turns powf/sinf/cosf into __powf (exp2 of y * log2 x through approximate exp2 and
# log2) and __sinf/__cosf (a short fp32 range reduction): a relative angle error of order 1e-7,
# several fp32 ulps; 4e-6 leaves a x10 margin.
ANGLE_REL_ERR_FAST_MATH = 4e-6


def ulp(magnitude: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype`` at ``magnitude`` (the spacing at 1.0 when the magnitude is 0)."""
    exponent = math.floor(math.log2(magnitude)) if magnitude > 0 else 0
    return 2.0 ** (exponent - MANTISSA_BITS[dtype])


def tolerance(ref: torch.Tensor, dtype: torch.dtype, *, steps: float,
              angle_rel_err: float = 0.0, angle: torch.Tensor | None = None,
              pair_magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """Element-wise tolerance for ``ref`` (float64) in output ``dtype`` (see module doc)."""
    base = steps * ulp(float(ref.abs().max()) if ref.numel() else 0.0, dtype)
    tol = torch.full_like(ref, base)
    if angle_rel_err:
        if angle is None or pair_magnitude is None:
            raise ValueError("an angle tolerance needs the per-element angle and pair magnitude")
        rot = angle.shape[-1]
        tol[..., :rot] += angle_rel_err * angle.abs() * pair_magnitude
    return tol
