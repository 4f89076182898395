"""OneFlow's ``fused_apply_rotary_emb`` (IntervalKernel and PlaneKernel) on CuPy RawKernels.

Upstream (Apache-2.0), re-implemented from the design rather than copied:

* ``Oneflow-Inc/oneflow@05ec5c10:oneflow/user/kernels/fused_attention_kernels.cu``
  (``FusedApplyRotaryEmbParam``, ``IntervalKernel``, ``PlaneKernel``, ``LaunchKernel``,
  ``DispatchPackSize``, ``DispatchIndex``, ``FusedApplyRotaryEmbKernel`` and its ``ParseDims``);
  the rotary code dates from ``8c489e45`` and is unchanged up to ``25c8978c``. Ported in
  ``fused_apply_rotary_emb.cu`` and ``_launch.py``.
* ``oneflow/core/functional/impl/fused_attention_functor.cpp`` (``FusedApplyRotaryEmbFunctor``:
  the defaults and checks of :func:`fused_apply_rotary_emb`), ``oneflow/core/functional/
  functional_api.yaml`` (the signature), ``oneflow/user/ops/fused_attention_ops.cpp``
  (``FusedApplyRotaryEmbOp``: dtype check, output shape), ``oneflow/core/cuda/elementwise.cuh``
  (``Packed<T, P>``), ``python/oneflow/test/modules/test_fused_rotary_embedding.py`` (the
  semantics of 2-D position_ids and of the table layouts).

Files: this module (API and autograd), ``_launch.py`` (host checks, layouts and the launch plan),
``fused_apply_rotary_emb.cu`` (the kernels), ``canonical.py`` (registry entries).

**Naming** (kept from upstream): ``mode="plane"`` (the default) is *rotate-half* inside each
rotary section, pairs ``(k, k + R/(2E))``; ``mode="interval"`` is *interleaved*, pairs
``(2i, 2i+1)``. ``E`` (``position_ids.shape[1]``, 1 or 2) is the number of rotary sections: with
``E = 2`` (GLM-style 2-D rotary) the rotated width ``R`` is split into two halves, the first
rotated by ``position_ids[:, 0]`` and the second by ``position_ids[:, 1]``, each an independent
rotation of width ``R/2`` with frequencies ``base^(-2j/(R/2))``.

DESIGN (kept from upstream):

* One launch per call of a 1-D grid of 128-thread blocks, ``ceil(num_elements / 128)`` blocks,
  with a grid-stride loop. Interval mode: ``P`` elements per thread (vector loads/stores), ``P``
  the largest of 8, 4 with ``x.data_ptr() % (P * itemsize) == 0``, ``(R/E) % P == 0``,
  ``(K - R) % P == 0`` and ``P * itemsize <= 16``, else 2 (fp32: ``P <= 4``; fp16/bf16:
  ``P <= 8``). Plane mode: one element per thread (scalar loads), ``num_elements`` rounded down to
  a multiple of that ``P``.
* Per-element index decomposition: flat offset -> logical ``(b, m, h, k)`` by dividing by
  ``{M*H*K, H*K, K, 1}``; memory offsets through each tensor's layout strides.
* int32 indexing when ``B*M*H*K < 2^30``, else int64 (two template instantiations), and int32 or
  int64 ``position_ids`` (two more).
* Layouts ``BMHK``, ``BHMK``, ``MBHK``, ``BM(HK)``, ``MB(HK)`` and packed ``BM(H2K)``,
  ``MB(H2K)``, ``BM(H3K)``, ``MB(H3K)`` (per-head interleaved ``[H, n, K]``) with
  ``tensor_index`` (``(H3K)``: 0, 1, 2 = q, k, v; ``(H2K)``: 1, 2 = k, v); ``output_layout`` any
  unpacked layout; the output is a new tensor shaped by ``output_layout``.
* Partial rotary through ``rotary_size`` (channels ``[R, K)`` are copied).
* cos/sin given (``[rows, R/E]`` in x's dtype, read per element at row ``position``), or computed
  in the kernel from ``base``.
* **The precision quirk, kept by default**: the angle is rounded to x's dtype before ``cosf`` and
  ``sinf`` (``theta = T(1/base)``, ``angle = T(pos * expf(2j/(R/E) * logf(theta)))``), and
  ``x*cos -/+ x'*sin`` is evaluated with T operators (fp16/bf16: every operation rounds to T).
  In fp16/bf16 the angle keeps only 11 / 8 significant bits, so at long positions it is off by
  radians (position 2047, bf16, pair 1 of R = 128: about 3 rad). Keyword ``fp32_angle=True``
  (an extension, registered separately as ``oneflow.*_fp32_angle``) keeps theta and the angle in
  fp32; cos/sin are still rounded to T and the arithmetic is still T. For fp32 inputs the two are
  the same kernel.
* No backward: upstream registers no gradient for this op. Outputs of inputs that require grad
  carry a ``grad_fn`` whose backward raises ``NotImplementedError`` (a silent detach would be a
  trap).

Departures from upstream (each listed; the arithmetic is unchanged):

* Host checks raise before any launch, as ``TypeError`` (types, dtypes), ``ValueError``
  (shapes, values, device) or ``NotImplementedError`` (valid but refused); the device check comes
  last. Upstream's messages are kept where it has one. Where upstream aborts the process
  (``CHECK`` in the kernel's ``ParseDims``: ``(H2K)`` with ``tensor_index=0``, a 3-D layout
  without ``k_size``) the port raises ``ValueError``.
* **Memory-safety bug refused**: plane mode with given cos/sin reads ``cos[pos * K + kk]``
  although the table is ``[rows, R/E]``: wrong rows and out-of-bounds reads whenever
  ``K != R/E`` (partial rotary, or 2-D position_ids). Such calls raise ``NotImplementedError``;
  the extension keyword ``fix_plane_table_stride=True`` runs them with the evident intent, row
  stride ``R/E`` (what interval mode uses). When ``K == R/E`` both are the same stride.
* Plane kernel: pass-through elements (``k >= R``) no longer read position_ids, cos or sin.
  Upstream reads them for every element; with 1-D position_ids and ``R < K`` they pick section 1
  and read ``position_ids[b*M + M + m]``, past the end for the last batch. The output is
  unchanged (those elements are copies of x).
* More guards than upstream: ``K`` must be even (odd ``K`` misaligns the unchecked ``P = 2``
  fallback and drops the last element in plane mode); ``rotary_size`` must be positive and a
  multiple of ``2 * E`` (upstream checks ``(R // E) % 2 == 0`` only, so an odd ``R`` with
  ``E = 2`` passes and misaligns); ``k_size`` must be positive; x, cos, sin and position_ids must
  be contiguous (upstream's layouts assume dense tensors); interval mode needs x, cos and sin
  aligned to the pack (upstream checks only x's base pointer for ``P = 4, 8`` and nothing for
  ``P = 2``); with given tables, ``position_ids`` must lie in ``[0, rows)`` (a host check that
  synchronises; the extension keyword ``check_position_ids=False`` skips it).
* Index width: int64 is also used when a packed ``(H2K)``/``(H3K)`` input, the output or the
  tables have offsets past ``2^31 - 1`` although ``B*M*H*K < 2^30`` (upstream overflows there).
  Grids past CUDA's x limit are refused.
* Outputs are new tensors allocated through :mod:`ports._alloc`; empty inputs return an empty
  output without a launch (upstream skips the kernel too).
* Upstream's parameter struct passed by value is flattened into scalar kernel arguments; theta is
  passed as the float ``1.0f / base`` and rounded to T in the kernel (upstream rounds on the
  host; same bits).
* The output layout follows upstream's later op: the output is shaped by ``output_layout``, which
  must not be packed. (The op file at ``05ec5c10`` is an early draft that allocates x's shape and
  checks ``output_layout`` only through a ``has_input`` call that never fires.)
"""
from __future__ import annotations

import torch

from ports.oneflow import _launch
from ports.oneflow._launch import (
    MODULE_BF16,
    MODULE_FP16,
    MODULE_FP32,
    kernel_names,
    layout_to_shape,
    pack_size,
    parse_dims,
    plan_launch,
)


class _NoBackward(torch.autograd.Function):
    """Forward as usual; backward raises: OneFlow registers no gradient for this op."""

    @staticmethod
    def forward(ctx, fn, x):
        return fn()

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(
            "fused_apply_rotary_emb has no backward: OneFlow registers no gradient function for "
            "it, and this port adds none")


def fused_apply_rotary_emb(
        x: torch.Tensor, *, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None, x_layout: str = "BHMK",
        output_layout: str | None = None, mode: str = "plane", tensor_index: int | None = None,
        k_size: int | None = None, base: float = 1e4, rotary_size: int | None = None,
        fp32_angle: bool = False, fix_plane_table_stride: bool = False,
        check_position_ids: bool = True,
) -> torch.Tensor:
    """Rotary position embedding of ``x``, OneFlow's fused kernel (one launch).

    Parameters (upstream's, keyword-only after ``x`` as in ``functional_api.yaml``)
    ---------------------------------------------------------------------------------
    x : torch.Tensor
        float32, float16 or bfloat16, contiguous CUDA tensor in ``x_layout``.
    cos, sin : torch.Tensor, optional
        Both or neither: ``[rows, R/E]`` in x's dtype, per element (row ``position``, column
        ``k mod R/E``); interval mode expects the interleaved-duplicated layout, plane mode the
        concatenated one. Without position_ids, ``rows >= M``. If absent, they are computed in the
        kernel from ``base`` (angle rounded to x's dtype unless ``fp32_angle``).
    position_ids : torch.Tensor, optional
        int32 or int64 ``[B, 1, M]`` (1-D) or ``[B, 2, M]`` (2-D rotary: the first ``R/2`` rotated
        channels use ``position_ids[:, 0]``, the next ``R/2`` use ``position_ids[:, 1]``).
        Default: position ``m``.
    x_layout : str
        ``"BHMK"`` (default), ``"BMHK"``, ``"MBHK"``, ``"BM(HK)"``, ``"MB(HK)"``, or packed
        ``"BM(H2K)"``, ``"MB(H2K)"``, ``"BM(H3K)"``, ``"MB(H3K)"`` (3-D layouts need ``k_size``).
    output_layout : str, optional
        Layout of the new output (default ``x_layout``; never packed).
    mode : str
        ``"plane"`` (default): rotate-half per rotary section; ``"interval"``: interleaved.
    tensor_index : int, optional
        Slice of a packed layout: ``(H3K)`` 0/1/2 = q/k/v; ``(H2K)`` 1/2 = k/v. Default 0.
    k_size : int, optional
        Head size K (required for 3-D layouts; must match K otherwise).
    base : float
        RoPE base for computed angles (``theta = 1/base``); ignored with cos/sin.
    rotary_size : int, optional
        R, the rotated channels (default K); ``[R, K)`` pass through.
    fp32_angle : bool, keyword-only extension
        Keep theta and the angle in fp32 (upstream rounds them to x's dtype). Default False.
    fix_plane_table_stride : bool, keyword-only extension
        Plane mode with given cos/sin and ``K != R/E``: read rows with stride ``R/E`` instead of
        refusing the call (upstream's stride ``K`` reads out of bounds). Default False.
    check_position_ids : bool, keyword-only extension
        With given cos/sin, verify ``0 <= position_ids < rows`` on the host (a device sync).

    Returns
    -------
    torch.Tensor
        A new tensor of x's dtype in ``output_layout``.

    Examples
    --------
    >>> q = torch.randn(2, 16, 4, 64, device="cuda", dtype=torch.float16)  # doctest: +SKIP
    >>> out = fused_apply_rotary_emb(q, x_layout="BMHK", mode="interval")  # doctest: +SKIP
    """
    call = _launch.check(x, cos, sin, position_ids, x_layout, output_layout, mode, tensor_index,
                         k_size, base, rotary_size, fp32_angle, fix_plane_table_stride,
                         check_position_ids)
    fp32_angle = bool(fp32_angle)

    def run():
        return _launch.rope(x, cos, sin, position_ids, call, mode, float(base), fp32_angle)

    if torch.is_grad_enabled() and x.requires_grad:
        return _NoBackward.apply(run, x)
    return run()



__all__ = ["fused_apply_rotary_emb", "parse_dims", "layout_to_shape", "pack_size",
           "plan_launch", "kernel_names", "MODULE_FP32", "MODULE_FP16", "MODULE_BF16"]
