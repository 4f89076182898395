"""OneFlow's ``fused_apply_rotary_emb`` (IntervalKernel and PlaneKernel) on CuPy RawKernels.

Upstream (Apache-2.0), re-implemented from the design rather than copied:

* ``Oneflow-Inc/oneflow:oneflow/user/kernels/fused_attention_kernels.cu``
  (``FusedApplyRotaryEmbParam``, ``IntervalKernel``, ``PlaneKernel``, ``LaunchKernel``,
  ``DispatchPackSize``, ``DispatchIndex``, ``FusedApplyRotaryEmbKernel`` and its ``ParseDims``),
  read at the stored version ``05ec5c10``; the rotary code dates from ``8c489e45`` (#9914,
  2023-04-09) and is unchanged up to HEAD ``25c8978c`` (PORTING.md §0). Ported in
  ``fused_apply_rotary_emb.cu``.
* ``oneflow/core/functional/impl/fused_attention_functor.cpp`` (``FusedApplyRotaryEmbFunctor``:
  the defaults and checks of :func:`fused_apply_rotary_emb`), ``oneflow/core/functional/
  functional_api.yaml`` (the signature), ``oneflow/user/ops/fused_attention_ops.cpp``
  (``FusedApplyRotaryEmbOp``: dtype check, output shape), ``oneflow/core/cuda/elementwise.cuh``
  (``Packed<T, P>``), ``python/oneflow/test/modules/test_fused_rotary_embedding.py`` (the
  semantics of 2-D position_ids and of the table layouts).

**Naming** (kept from upstream): ``mode="plane"`` (the default) is *rotate-half* inside each
rotary section, pairs ``(k, k + R/(2E))``; ``mode="interval"`` is *interleaved*, pairs
``(2i, 2i+1)``. ``E`` (``position_ids.shape[1]``, 1 or 2) is the number of rotary sections: with
``E = 2`` (GLM-style 2-D rotary) the rotated width ``R`` is split into two halves, the first
rotated by ``position_ids[:, 0]`` and the second by ``position_ids[:, 1]``, each an independent
rotation of width ``R/2`` with frequencies ``base^(-2j/(R/2))``.

Design kept:

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
  In fp16/bf16 the angle loses ~11 / 8 bits: at position 2047 the bf16 angle of pair 1 (R=128)
  is off by ~3 rad. Keyword ``fp32_angle=True`` (an extension, registered separately as
  ``oneflow.*_fp32_angle``) keeps theta and the angle in fp32; cos/sin are still rounded to T and
  the arithmetic is still T. For fp32 inputs the two are the same kernel.
* No backward: upstream registers no gradient for this op. Outputs of inputs that require grad
  carry a ``grad_fn`` whose backward raises ``NotImplementedError`` (a silent detach would be a
  trap).

Departures from upstream (each listed; the arithmetic is unchanged):

* Host checks raise before any launch, as ``TypeError`` (types, dtypes), ``ValueError``
  (shapes, values, device) or ``NotImplementedError`` (valid but refused); the device check comes
  last. Upstream's messages are kept where it has one. Where upstream aborts the process
  (``CHECK`` in the kernel's ``ParseDims``: ``(H2K)`` with ``tensor_index=0``, a 3-D layout
  without ``k_size``) the port raises ``ValueError``.
* **Memory-safety bug refused** (PORTING.md §5.6-2): plane mode with given cos/sin reads
  ``cos[pos * K + kk]`` although the table is ``[rows, R/E]``: wrong rows and out-of-bounds
  reads whenever ``K != R/E`` (partial rotary, or 2-D position_ids). Such calls raise
  ``NotImplementedError``; the extension keyword ``fix_plane_table_stride=True`` runs them with
  the evident intent, row stride ``R/E`` (what interval mode uses). When ``K == R/E`` both are
  the same stride.
* Plane kernel: pass-through elements (``k >= R``) no longer read position_ids, cos or sin.
  Upstream reads them for every element; with 1-D position_ids and ``R < K`` they pick section 1
  and read ``position_ids[b*M + M + m]``, past the end for the last batch (§5.6-3). The output
  is unchanged (those elements are copies of x).
* More guards than upstream: ``K`` must be even (odd ``K`` misaligns the unchecked ``P = 2``
  fallback and drops the last element in plane mode, §5.6-4); ``rotary_size`` must be positive
  and a multiple of ``2 * E`` (upstream checks ``(R // E) % 2 == 0`` only, so an odd ``R`` with
  ``E = 2`` passes and misaligns); ``k_size`` must be positive; x, cos, sin and position_ids must
  be contiguous (upstream's layouts assume dense tensors); interval mode needs x, cos and sin
  aligned to the pack (upstream checks only x's base pointer for ``P = 4, 8`` and nothing for
  ``P = 2``, §5.6-5); with given tables, ``position_ids`` must lie in ``[0, rows)`` (a host check
  that synchronises; the extension keyword ``check_position_ids=False`` skips it).
* Index width: int64 is also used when a packed ``(H2K)``/``(H3K)`` input, the output or the
  tables have offsets past ``2^31 - 1`` although ``B*M*H*K < 2^30`` (upstream overflows, §5.6-6).
  Grids past CUDA's x limit are refused.
* Outputs are new tensors allocated through :mod:`ports._alloc`; empty inputs return an empty
  output without a launch (upstream skips the kernel too).
* Upstream's parameter struct passed by value is flattened into scalar kernel arguments; theta is
  passed as the float ``1.0f / base`` and rounded to T in the kernel (upstream rounds on the
  host; same bits).
* The output layout: the stored op file is an early draft (it allocates x's shape and checks
  ``output_layout`` only through a ``has_input`` call that never fires); the port follows
  PORTING.md §5.1/§5.2 (HEAD): output shaped by ``output_layout``, which must not be packed.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np
import torch

from ports import _alloc, _cupy

BLOCK_SIZE = 128
INT32_INDEX_LIMIT = 1 << 30  # DispatchIndex: int32 when B*M*H*K < 2^30
MAX_GRID_X = 2**31 - 1
MAX_PACK_BYTES = 16

_CTYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
_POSITION_CTYPE = {torch.int32: "int", torch.int64: "long long"}
MODES = ("plane", "interval")

LAYOUTS_4D = ("BMHK", "BHMK", "MBHK")
LAYOUTS_3D = ("BM(HK)", "MB(HK)", "BM(H2K)", "MB(H2K)", "BM(H3K)", "MB(H3K)")
OUTPUT_LAYOUTS = ("BMHK", "BHMK", "MBHK", "BM(HK)", "MB(HK)")
_PACKED_N = {"(HK)": 1, "(H2K)": 2, "(H3K)": 3}


def _pack_sizes(dtype: torch.dtype) -> tuple[int, ...]:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return tuple(p for p in (2, 4, 8) if p == 2 or p * itemsize <= MAX_PACK_BYTES)


def kernel_names(dtype: torch.dtype) -> tuple[str, ...]:
    """Every instantiation for one dtype (fp32 has no separate fp32-angle instantiation)."""
    t = _CTYPE[dtype]
    angles = ("false",) if dtype == torch.float32 else ("false", "true")
    names = []
    for pos in _POSITION_CTYPE.values():
        for idx in ("int", "long long"):
            for dim in (1, 2):
                for angle in angles:
                    names += [f"oneflow_interval<{t}, {pos}, {idx}, {p}, {dim}, {angle}>"
                              for p in _pack_sizes(dtype)]
                    names.append(f"oneflow_plane<{t}, {pos}, {idx}, {dim}, {angle}>")
    return tuple(names)


# One module per dtype, so a call compiles only its dtype's instantiations (first use only).
MODULE_FP32 = _cupy.CudaModule(__name__, "fused_apply_rotary_emb.cu",
                               kernels=kernel_names(torch.float32))
MODULE_FP16 = _cupy.CudaModule(__name__, "fused_apply_rotary_emb.cu",
                               kernels=kernel_names(torch.float16))
MODULE_BF16 = _cupy.CudaModule(__name__, "fused_apply_rotary_emb.cu",
                               kernels=kernel_names(torch.bfloat16))
MODULES = {torch.float32: MODULE_FP32, torch.float16: MODULE_FP16, torch.bfloat16: MODULE_BF16}


# ---- layouts (the kernel's ParseDims and the op's LayoutToShape) ---------------------------------
class Dims(NamedTuple):
    """What ``ParseDims`` reads from a dense tensor in a layout: sizes, strides, slice offset."""

    b: int
    m: int
    h: int
    k: int
    b_stride: int
    m_stride: int
    h_stride: int
    offset: int


def parse_dims(shape: tuple[int, ...], layout: str, k_size: int | None, tensor_index: int,
               name: str = "x") -> Dims:
    """The kernel-side ``ParseDims``: sizes and element strides of a dense tensor in ``layout``."""
    if len(shape) == 4:
        if layout not in LAYOUTS_4D:
            raise ValueError(f"{name}_layout should be 'BMHK', 'BHMK' or 'MBHK' when the number "
                             f"of dimensions of {name} tensor is 4 (got {layout!r})")
        if layout == "BMHK":
            b, m, h, k = shape
            h_stride, m_stride = k, h * k
            b_stride = m * m_stride
        elif layout == "BHMK":
            b, h, m, k = shape
            m_stride, h_stride = k, m * k
            b_stride = h * h_stride
        else:  # MBHK
            m, b, h, k = shape
            h_stride, b_stride = k, h * k
            m_stride = b * b_stride
        if k_size is not None and k_size != k:
            raise ValueError(f"k_size if given should be equal to K of cos, sin and x "
                             f"(k_size={k_size}, K={k})")
        return Dims(b, m, h, k, b_stride, m_stride, h_stride, 0)
    if len(shape) == 3:
        if layout not in LAYOUTS_3D:
            raise ValueError(
                f"{name}_layout should be 'BM(HK)', 'MB(HK)', 'BM(H2K)', 'MB(H2K)', 'BM(H3K)' or "
                f"'MB(H3K)' when the number of dimensions of {name} tensor is 3 (got {layout!r}; "
                "'(BM)HK' needs batch_size and seq_len, which this op does not take)")
        if k_size is None:
            raise ValueError(f"k_size must be given for the 3-D layout {layout!r} (K cannot be "
                             "inferred; upstream fails a CHECK)")
        packed_n = _PACKED_N[layout[2:]]
        if layout.startswith("BM"):
            b, m, hidden = shape
        else:
            m, b, hidden = shape
        if hidden % (packed_n * k_size):
            raise ValueError(f"The size of the last dimension of the {name} tensor should be a "
                             f"multiple of {packed_n * k_size}.")
        h, k = hidden // (packed_n * k_size), k_size
        h_stride = k * packed_n
        if layout.startswith("BM"):
            m_stride = h_stride * h
            b_stride = m_stride * m
        else:
            b_stride = h_stride * h
            m_stride = b_stride * b
        if packed_n == 1:
            offset = 0
        elif packed_n == 2:
            if tensor_index < 1:
                raise ValueError(f"tensor_index must be 1 (k) or 2 (v) for the packed layout "
                                 f"{layout!r}, got {tensor_index} (upstream aborts on a CHECK)")
            offset = (tensor_index - 1) * k
        else:
            offset = tensor_index * k
        return Dims(b, m, h, k, b_stride, m_stride, h_stride, offset)
    raise ValueError(f"The number of dimensions of the {name} tensor should be 3 or 4, got "
                     f"shape {tuple(shape)}")


def layout_to_shape(b: int, m: int, h: int, k: int, layout: str) -> tuple[int, ...]:
    """The op's ``LayoutToShape``: the shape of an output in ``layout``."""
    shapes = {"BMHK": (b, m, h, k), "BHMK": (b, h, m, k), "MBHK": (m, b, h, k),
              "BM(HK)": (b, m, h * k), "MB(HK)": (m, b, h * k)}
    if layout not in shapes:
        raise ValueError(f"output_layout should be one of {', '.join(OUTPUT_LAYOUTS)} (packed "
                         f"layouts are inputs only: call once per tensor_index), got {layout!r}")
    return shapes[layout]


def pack_size(x_ptr: int, itemsize: int, rotary_size: int, rotary_emb_dim: int, k: int) -> int:
    """``DispatchPackSize``: 8 or 4 if x's base pointer, R/E and K-R allow it, else 2.

    >>> pack_size(0x1000, 2, 128, 1, 128), pack_size(0x1000, 4, 128, 1, 128)
    (8, 4)
    >>> pack_size(0x1004, 2, 128, 1, 128), pack_size(0x1000, 2, 64, 2, 128)
    (2, 8)
    >>> pack_size(0x1000, 2, 12, 1, 16)  # R/E = 12: not a multiple of 8
    4
    """
    for p in (8, 4):
        if (x_ptr % (itemsize * p) == 0 and (rotary_size // rotary_emb_dim) % p == 0
                and (k - rotary_size) % p == 0 and MAX_PACK_BYTES // itemsize >= p):
            return p
    return 2


# ---- host checks ---------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, (numbers.Integral, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_optional_int(value, name: str) -> None:
    if value is not None and not _is_int(value):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")


class _Call(NamedTuple):
    """Everything a launch needs, decided on the host (what the CPU tests inspect)."""

    dims: Dims
    out_dims: Dims
    out_shape: tuple[int, ...]
    rotary_size: int
    rotary_emb_dim: int
    table_stride: int
    device: int


def _check(x, cos, sin, position_ids, x_layout, output_layout, mode, tensor_index, k_size, base,
           rotary_size, fp32_angle, fix_plane_table_stride, check_position_ids) -> _Call:
    """The functor's and op's checks plus the port's guards, in upstream's order; device last."""
    _cupy.check_tensor(x, "x")
    _cupy.check_dtype(x, "x", _CTYPE)
    for flag, value in (("fp32_angle", fp32_angle),
                        ("fix_plane_table_stride", fix_plane_table_stride),
                        ("check_position_ids", check_position_ids)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
    for name, value in (("x_layout", x_layout), ("mode", mode)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if output_layout is not None and not isinstance(output_layout, str):
        raise TypeError(f"output_layout must be a str or None, got {type(output_layout).__name__}")
    for name, value in (("tensor_index", tensor_index), ("k_size", k_size),
                        ("rotary_size", rotary_size)):
        _check_optional_int(value, name)
    if isinstance(base, (bool, np.bool_)) or not isinstance(base, numbers.Real):
        raise TypeError(f"base must be a float, got {type(base).__name__}")

    # FusedApplyRotaryEmbFunctor
    if tensor_index is not None and not 0 <= tensor_index <= 2:
        raise ValueError(f"tensor_index should be set between [0, 2], got {tensor_index}")
    if mode not in MODES:
        raise ValueError(f'mode should be "intervel" or "plane", got {mode!r}')
    if k_size is not None and k_size <= 0:
        raise ValueError(f"k_size must be positive, got {k_size}")
    index = 0 if tensor_index is None else int(tensor_index)
    dims = parse_dims(tuple(x.shape), x_layout, None if k_size is None else int(k_size), index)
    b, m, h, k = dims.b, dims.m, dims.h, dims.k
    if rotary_size is not None:
        if rotary_size > k:
            raise ValueError(f"rotary_size should be no more than k (rotary_size={rotary_size}, "
                             f"k={k})")
        if rotary_size <= 0:
            raise ValueError(f"rotary_size must be positive, got {rotary_size}")

    emb_dim = 1
    if position_ids is not None:
        _cupy.check_tensor(position_ids, "position_ids")
        if position_ids.dtype not in _POSITION_CTYPE:
            raise TypeError(f"position_ids must be int32 or int64 (the kernels registered "
                            f"upstream), got {position_ids.dtype}")
        if position_ids.dim() != 3:
            raise ValueError("ndims of position_ids should be equal to 3, either in form of B1M "
                             f"or B2M (got shape {tuple(position_ids.shape)})")
        if position_ids.shape[0] != b:
            raise ValueError(f"1st dim of position_ids should be equal to B ({b}), got "
                             f"{position_ids.shape[0]}")
        if position_ids.shape[2] != m:
            raise ValueError(f"3rd dim of position_ids should be equal to M ({m}), got "
                             f"{position_ids.shape[2]}")
        emb_dim = position_ids.shape[1]
        if emb_dim not in (1, 2):
            raise ValueError(f"2nd dim of position_ids should be 1 or 2, got {emb_dim}")
        _cupy.check_contiguous(position_ids, "position_ids")

    rot = k if rotary_size is None else int(rotary_size)
    if rot % (2 * emb_dim):
        raise ValueError(f"k ,or rotary_size if given, should be a multiple of 2 * "
                         f"rotary_encoding_dim (got {rot}, rotary_encoding_dim {emb_dim})")
    actual = rot // emb_dim
    if k % 2:
        raise NotImplementedError(
            f"K must be even, got {k}: the unchecked pack-of-2 fallback would misalign and plane "
            "mode would skip the last element (PORTING.md §5.6-4; upstream does not check)")

    if (cos is None) != (sin is None):
        raise ValueError("cos & sin should both be given or not given.")
    table_stride = k
    if cos is not None:
        _cupy.check_tensor(cos, "cos")
        _cupy.check_tensor(sin, "sin")
        if cos.dim() != 2:
            raise ValueError(f"The number of dimensions of cos should be equal to 2, got shape "
                             f"{tuple(cos.shape)}")
        if cos.shape != sin.shape:
            raise ValueError(f"Each dimension of cos & sin should be the same (cos "
                             f"{tuple(cos.shape)}, sin {tuple(sin.shape)})")
        if cos.shape[1] != actual:
            raise ValueError(f"The 1st dimension of cos & sin should equal to rotary_size // "
                             f"rotary_embedding_dimension = {actual}, got {cos.shape[1]}")
        if position_ids is None and cos.shape[0] < m:
            raise ValueError(f"M of cos & sin should be to no less than M of x when position_ids "
                             f"is not given (cos has {cos.shape[0]} rows, M = {m})")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype != x.dtype:
                raise TypeError(f"InferDataType Failed. Expected {x.dtype}, but got {t.dtype} "
                                f"({name})")
            _cupy.check_contiguous(t, name)
        if mode == "plane" and k != actual:
            if not fix_plane_table_stride:
                raise NotImplementedError(
                    f"plane mode with given cos/sin reads them with row stride K = {k} but they "
                    f"have {actual} columns (rotary_size // rotary_embedding_dimension): upstream "
                    "reads the wrong rows and out of bounds (PORTING.md §5.6-2), so this port "
                    "refuses it; pass fix_plane_table_stride=True for row stride "
                    f"{actual}, or use full rotary with 1-D position_ids")
            table_stride = actual
        if position_ids is not None and check_position_ids and position_ids.numel():
            lo, hi = int(position_ids.min()), int(position_ids.max())
            if lo < 0 or hi >= cos.shape[0]:
                raise ValueError(f"position_ids span [{lo}, {hi}] but cos/sin have "
                                 f"{cos.shape[0]} rows (upstream would read out of bounds)")

    out_layout = x_layout if output_layout is None else output_layout
    out_shape = layout_to_shape(b, m, h, k, out_layout)
    out_dims = parse_dims(out_shape, out_layout, k, 0, "output")
    _cupy.check_contiguous(x, "x")
    extra = [(n, t) for n, t in (("cos", cos), ("sin", sin), ("position_ids", position_ids))
             if t is not None]
    device = _cupy.check_cuda(("x", x), *extra)
    return _Call(dims, out_dims, out_shape, rot, emb_dim, table_stride, device)


# ---- launch --------------------------------------------------------------------------------------
class Launch(NamedTuple):
    module: _cupy.CudaModule
    kernel: str
    grid: tuple[int]
    block: tuple[int]
    args: tuple
    pack_size: int
    index_bits: int


def plan_launch(x, cos, sin, position_ids, out, call: _Call, mode: str, base: float,
                fp32_angle: bool) -> Launch:
    """``DispatchRotaryEmbeddingDimension`` -> ``DispatchIndex`` -> ``DispatchPackSize`` ->
    ``LaunchKernel``: the instantiation, grid and arguments of the one launch."""
    d, o = call.dims, call.out_dims
    itemsize = x.element_size()
    emb, rot = call.rotary_emb_dim, call.rotary_size
    numel = d.b * d.m * d.h * d.k
    offsets = [x.numel(), out.numel()] + [t.numel() for t in (cos, position_ids) if t is not None]
    wide = numel >= INT32_INDEX_LIMIT or max(offsets) > _cupy.INT32_MAX
    idx = _cupy.i64 if wide else _cupy.i32
    p = pack_size(x.data_ptr(), itemsize, rot, emb, d.k)
    if mode == "interval":
        for name, t in (("x", x), ("cos", cos), ("sin", sin), ("out", out)):
            if t is not None:
                _cupy.check_aligned(t, name, p * itemsize)
        num_elements = numel // p
    else:
        num_elements = numel // p * p
    blocks = -(-num_elements // BLOCK_SIZE)
    if blocks > MAX_GRID_X:
        raise NotImplementedError(f"{blocks} blocks exceed CUDA's grid x limit ({MAX_GRID_X})")
    position_ctype = _POSITION_CTYPE[torch.int64 if position_ids is None else position_ids.dtype]
    angle = "true" if fp32_angle and x.dtype != torch.float32 else "false"
    ctype, index_ctype = _CTYPE[x.dtype], ("long long" if wide else "int")
    if mode == "interval":
        kernel = f"oneflow_interval<{ctype}, {position_ctype}, {index_ctype}, {p}, {emb}, {angle}>"
    else:
        kernel = f"oneflow_plane<{ctype}, {position_ctype}, {index_ctype}, {emb}, {angle}>"
    actual = rot // emb
    position_m = d.m if position_ids is None else position_ids.shape[2]
    args = (
        _cupy.ptr(x), _cupy.ptr(cos), _cupy.ptr(sin), _cupy.ptr(position_ids), _cupy.ptr(out),
        _cupy.f32(np.float32(1.0) / np.float32(base)),   # theta = 1.0f / (float)base
        _cupy.f32(1.0 / actual),                          # (float)(1.0 / actual_rotary_size)
        idx(actual), idx(rot), idx(rot // (2 * emb)),     # actual_rotary_size, R, rotate_stride
        idx(actual), idx(rot),                            # k0, k1
        idx(num_elements), idx(call.table_stride), idx(d.offset),
        idx(d.m * d.h * d.k), idx(d.h * d.k), idx(d.k),   # reference (logical BMHK) strides
        idx(d.b_stride), idx(d.m_stride), idx(d.h_stride),
        idx(o.b_stride), idx(o.m_stride), idx(o.h_stride),
        idx(position_m * emb), idx(position_m),           # position b / rotate strides
        idx(actual),                                      # sinuous_m_stride
    )
    return Launch(MODULES[x.dtype], kernel, (blocks,), (BLOCK_SIZE,), args, p, 64 if wide else 32)


def _forward(x, cos, sin, position_ids, call: _Call, mode: str, base: float,
             fp32_angle: bool) -> torch.Tensor:
    out = _alloc.empty(call.out_shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    launch = plan_launch(x, cos, sin, position_ids, out, call, mode, base, fp32_angle)
    _cupy.launch(launch.module, launch.kernel, call.device, launch.grid, launch.block, launch.args)
    return out


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
    call = _check(x, cos, sin, position_ids, x_layout, output_layout, mode, tensor_index, k_size,
                  base, rotary_size, fp32_angle, fix_plane_table_stride, check_position_ids)
    fp32_angle = bool(fp32_angle)

    def run():
        return _forward(x, cos, sin, position_ids, call, mode, float(base), fp32_angle)

    if torch.is_grad_enabled() and x.requires_grad:
        return _NoBackward.apply(run, x)
    return run()


__all__ = ["fused_apply_rotary_emb", "parse_dims", "layout_to_shape", "pack_size",
           "plan_launch", "kernel_names", "MODULE_FP32", "MODULE_FP16", "MODULE_BF16"]
