"""Registry entry for kernl's ``rbe_triton`` (seed 004), called from the canonical case.

The case's ``[b, s, h, d]`` tensor (``bshd``, or ``sbhd`` through a permuted view) is viewed as
kernl's ``[batch, M, h * d]`` without a copy (``h`` and ``d`` merge when ``stride(h) == d`` and
``stride(d) == 1``, true of contiguous tensors and of a q cut from a packed qkv). Positions are
``start_token_position + m``: ``arange`` (pos 0) only. Interleaved, full rotary, forward only.
The kernel computes its own angles from ``base``: the ``computed`` oracle with an angle term.
"""
from __future__ import annotations

import torch

from ports import _alloc
from ports._spec import FLOAT_DTYPES, ImplSpec
from ports._triton import MAX_GRID_Y
from reference.case import RopeCase, RopeInputs

# Relative angle error of pos / THETA ** ((n % D) / D) in fp32, for THETA = 1e4:
# * the exponent e = (n % D) / D rounds (D not a power of two): THETA ** e moves by
#   ln(THETA) * e * 2^-24 <= 9.2 * 6e-8 = 5.5e-7;
# * powf (~1 ulp) on a GPU, or exp2(e * log2 THETA) in the interpreter, where the product rounds:
#   log2(THETA) * e * 2^-24 * ln 2 <= 5.5e-7;
# * the division pos / f: 0.5 ulp (3e-8). Sum ~1.2e-6; 2e-6 leaves margin.
KERNL_ANGLE_REL_ERR = 2e-6


BLOCK_SIZE_M, BLOCK_SIZE_K = 2, 1024  # rbe_triton_wrapper's defaults, which _prepare uses


def _check(case: RopeCase) -> str | None:
    if case.base > 1e5:
        return "angle tolerance derived for base <= 1e5 (exponent rounding grows with ln base)"
    if case.table_rows + case.seqlen > 2**24:
        return "positions beyond 2^24 are not exact in fp32"
    tiles = -(-case.seqlen // BLOCK_SIZE_M) * -(-case.heads * case.head_dim // BLOCK_SIZE_K)
    if tiles > MAX_GRID_Y:
        return f"{tiles} tiles exceed CUDA's grid-y limit ({MAX_GRID_Y}) in kernl's 2-D grid"
    return None


def _prepare(case: RopeCase, inputs: RopeInputs):
    from ports import kernl

    if case.direction != "forward":
        raise NotImplementedError("kernl's rbe_triton has no backward")
    b, s, d = case.batch, case.seqlen, case.head_dim

    def one(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[2]
        bshd = x if case.layout == "bshd" else x.transpose(0, 1)
        x3 = bshd.view(b, s, h * d)
        if case.layout == "bshd":
            out = _alloc.empty((b, s, h, d), dtype=x.dtype, device=x.device)
            kernl.rbe_triton_wrapper(x3, 0, head_dim=d, theta=case.base, out=out.view(b, s, h * d))
        else:
            out = _alloc.empty((s, b, h, d), dtype=x.dtype, device=x.device)
            kernl.rbe_triton_wrapper(x3, 0, head_dim=d, theta=case.base,
                                     out=out.view(s, b, h * d).transpose(0, 1))
        return out

    return lambda: tuple(one(x) for x in inputs.xs)


SPECS = [
    ImplSpec(name="triton.kernl_rbe",
             launch='grid (batch, tiles of 2 tokens x 1024 channels)', per_thread='Triton tile',
             access='Triton-vectorized (even/odd strided)',
             math='fp32 pow/sin/cos per element from THETA', family="kernl", backend="triton",
             upstream="ELS-RD/kernl@da9db806:experimental/llama-v2/kernel/"
                      "fused_kernel_proj_qkv.py (rbe_triton) via seed 004",
             summary="tiles of BLOCK_M tokens x BLOCK_K channels, angles from THETA in-kernel",
             prepare=_prepare, styles=frozenset({"interleaved"}),
             layouts=frozenset({"bshd", "sbhd"}), dtypes=FLOAT_DTYPES,
             partial=False, positions=frozenset({"arange"}), backward=False,
             devices=frozenset({"cuda", "interpret"}), table_source="computed",
             angle_rel_err=KERNL_ANGLE_REL_ERR, check=_check),
]
