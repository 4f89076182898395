"""PaddlePaddle's ``fused_rotary_position_embedding``, V1 vectorized kernels, on CuPy RawKernels.

Upstream (Apache-2.0), re-implemented from the design rather than copied:

* ``PaddlePaddle/Paddle@09d06946:paddle/phi/kernels/fusion/gpu/fused_rope_utils.h``
  (the kernels, ported in ``fused_rope.cu``)
* ``PaddlePaddle/Paddle@e5b22f5e:paddle/phi/kernels/fusion/gpu/fused_rope_kernel.cu``
  (forward launcher: :func:`ports.paddle._launch.rope` with ``sign=+1``)
* ``PaddlePaddle/Paddle@5f908167:paddle/phi/kernels/fusion/gpu/fused_rope_grad_kernel.cu``
  (backward launcher, ``sign=-1``)
* ``PaddlePaddle/Paddle@09d06946:python/paddle/incubate/nn/functional/fused_rotary_position_embedding.py``
  (the public API, :func:`fused_rotary_position_embedding` here)
* ``PaddlePaddle/Paddle:paddle/phi/backends/gpu/gpu_launch_config.h`` (``GetGpuLaunchConfig1D``,
  :func:`launch_config_1d`)

Files: this module (API and autograd), ``_launch.py`` (host checks and launch), ``fused_rope.cu``
(the kernels), ``canonical.py`` (registry entries).

**Naming trap** (kept from upstream): ``use_neox_rotary_style=True`` (the default) selects the
*every-two / interleaved* (GPT-J) pairing ``(2i, 2i+1)``; ``use_neox_rotary_style=False`` selects
*rotate-half* (NeoX / HF-Llama) pairs ``(i, i + D/2)``. Upstream's docstring: "When
use_neox_rotary_style is True, every two adjacent numbers are calculated".

DESIGN (kept from upstream): a 1-D elementwise grid sized by
``GetGpuLaunchConfig1D(numel(q), vec_size=2)`` (block size from the SM count), a grid-stride loop
of two elements per thread, int64 index math,
fp32 math (MPType) for fp16/bf16/fp32 with one rounding at the store and fp64 math for fp64,
sin/cos either given (``[S', D]`` or ``[1, S', 1, D]`` in q's dtype, rows picked by position or
``position_ids``) or computed from ``rotary_emb_base`` (``s / base^(2*floor(d/2) * (1.0f/D))``,
interleaved frequency layout, with a specialised branch for the default base 10000), q, k and v
in **one** launch when their head counts match (three pointers + a count) and two launches (q;
then k and v together) for GQA/MQA. The backward launches the same kernels with ``sign = -1``
and saves only sin, cos and position_ids. Every-two backward is the exact transpose; rotate-half
backward uses each element's *own* sine, exact only for tables whose two halves are equal (the
concatenated layout) -- kept as upstream's numerics.

Departures from upstream (each listed; the arithmetic is unchanged):

* Host checks raise before any launch, as ``TypeError`` (types, dtypes), ``ValueError`` (shapes,
  values, device) or ``NotImplementedError`` (valid but unsupported); the device check comes last.
  Upstream's Python ``assert`` s (no sin/cos with ``position_ids``, or with rotate-half) become
  ``NotImplementedError``; giving only one of sin/cos (upstream silently computes both) is a
  ``ValueError``.
* Memory-safety guards upstream lacks:
  - rotate-half needs ``head_dim % 4 == 0`` (the 2-vector's partner is decided from its first
    element; with ``D % 4 == 2`` the element at ``D/2`` reads the next head):
    ``NotImplementedError``;
  - k and v must match q's batch, sequence and head_dim (upstream derives their indexing from
    q's, so a smaller k/v batch reads and writes out of bounds: Paddle#74347), must have at least
    one head (Paddle#78428) and q's dtype;
  - ``position_ids`` values must lie in ``[0, rows of sin/cos)`` (upstream reads out of bounds).
    This check synchronises with the device; ``check_position_ids=False`` (an extension
    keyword) skips it for callers that know their ids are in range;
  - the rotate-half kernel's non-default-base branch, which upstream runs once per thread with
    no bounds check, gets ``index < size`` in the kernel (no numerical change: the 1-D grid
    covers every element, which the host asserts).
* q, k, v, sin, cos and position_ids must be contiguous (upstream's kernels index them densely);
  non-contiguous inputs raise ``ValueError`` instead of being copied. The backward makes the
  incoming gradients contiguous (autograd may hand back zero-stride ones).
* Empty q returns empty outputs (upstream returns before allocating them).
* The kernel's pointer-array arguments are flattened (three input pointers, sin, cos, three
  output pointers, a count); its bool ``flag_sin_cos`` is an int.
* No gradient flows to sin/cos (upstream's grad op has no outputs for them either).
* Outputs are new tensors allocated through :mod:`ports._alloc` (contiguous, q's shape).
"""
from __future__ import annotations

import torch

from ports.paddle import _launch
from ports.paddle._launch import MODULE, LaunchConfig, launch_config_1d


class _FusedRope(torch.autograd.Function):
    """Forward with sign +1; backward launches the same kernels on the gradients with sign -1."""

    @staticmethod
    def forward(ctx, config, sin, cos, position_ids, *xs):
        ctx.config = config
        ctx.save_for_backward(*(t for t in (sin, cos, position_ids) if t is not None))
        ctx.present = (sin is not None, position_ids is not None)
        return tuple(_launch.rope(list(xs), sin, cos, position_ids, sign=1, **config))

    @staticmethod
    def backward(ctx, *grads):
        saved = list(ctx.saved_tensors)
        has_tables, has_ids = ctx.present
        sin, cos = (saved.pop(0), saved.pop(0)) if has_tables else (None, None)
        position_ids = saved.pop(0) if has_ids else None
        grads = [g.contiguous() for g in grads]
        dxs = _launch.rope(grads, sin, cos, position_ids, sign=-1, **ctx.config)
        return (None, None, None, None, *dxs)


def fused_rotary_position_embedding(
        q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
        sin: torch.Tensor | None = None, cos: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None, use_neox_rotary_style: bool = True,
        time_major: bool = False, rotary_emb_base: float = 10000.0, *,
        check_position_ids: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Rotary position embedding of q (and k, v), Paddle's V1 fused kernel; differentiable.

    Parameters
    ----------
    q : torch.Tensor
        ``[batch, seq_len, heads, head_dim]`` (``time_major=False``) or
        ``[seq_len, batch, heads, head_dim]`` (``time_major=True``); float32, float16, bfloat16
        or float64; contiguous CUDA tensor; ``head_dim`` even (``% 4 == 0`` for rotate-half).
    k, v : torch.Tensor, optional
        Like q, with q's batch, seq_len, head_dim and dtype. Their head count may be smaller
        (MQA/GQA: q's heads a multiple of theirs; k and v equal), which takes two launches.
    sin, cos : torch.Tensor, optional
        Per-element tables ``[rows, head_dim]`` or ``[1, rows, 1, head_dim]`` in q's dtype,
        contiguous; row ``p`` holds position ``p``. Note the order: **sin before cos**. Without
        position_ids, ``rows == seq_len``; with them, ``rows >= seq_len``. If neither is given
        they are computed in the kernel from ``rotary_emb_base`` (interleaved style only).
    position_ids : torch.Tensor, optional
        int64 ``[batch, seq_len]``, the table row of each token (given sin/cos only).
    use_neox_rotary_style : bool
        **True (default) = every-two / interleaved (GPT-J) pairs** ``(2i, 2i+1)``; False =
        rotate-half (NeoX) pairs ``(i, i + head_dim/2)``. The name is upstream's, inverted with
        respect to common usage.
    time_major : bool
        True for ``[seq_len, batch, heads, head_dim]`` (sbhd), False for bshd.
    rotary_emb_base : float
        Base of the computed angles ``s * base^(-2*floor(d/2)/head_dim)``. Also selects the
        kernel's branch (10000 is specialised) when sin/cos are given.
    check_position_ids : bool, keyword-only
        Extension: verify ``0 <= position_ids < rows`` on the host (a device sync). Default True.

    Returns
    -------
    (out_q, out_k, out_v)
        New contiguous tensors of the inputs' shapes and dtype; ``None`` where no input was given.

    Examples
    --------
    >>> q = torch.randn(2, 16, 4, 64, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> # interleaved pairs (use_neox_rotary_style=True), angles computed with base 10000
    >>> out_q, _, _ = fused_rotary_position_embedding(q)  # doctest: +SKIP
    """
    device = _launch.check_inputs(q, k, v, sin, cos, position_ids, use_neox_rotary_style,
                                  time_major, rotary_emb_base, check_position_ids)
    xs = [t for t in (q, k, v) if t is not None]
    config = dict(use_neox_rotary_style=bool(use_neox_rotary_style), time_major=bool(time_major),
                  rotary_emb_base=float(rotary_emb_base), device=device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in xs):
        outs = list(_FusedRope.apply(config, sin, cos, position_ids, *xs))
    else:
        outs = _launch.rope(xs, sin, cos, position_ids, sign=1, **config)
    it = iter(outs)
    return tuple(next(it) if t is not None else None for t in (q, k, v))


__all__ = ["fused_rotary_position_embedding", "launch_config_1d", "LaunchConfig", "MODULE"]
