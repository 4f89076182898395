"""Host checks and launch of the OneFlow port: the functor's and op's checks, ``ParseDims``, and
``LaunchKernel``'s dispatch (``DispatchRotaryEmbeddingDimension`` -> ``DispatchIndex`` ->
``DispatchPackSize``).

Everything is checked on the host before the one launch (a kernel that reads out of bounds
poisons the CUDA context for every later caller): argument types, then the functor's checks in
upstream's order (tensor_index, mode, k_size, x's layout, rotary_size, position_ids, cos/sin),
the port's guards among them, and the device last, so CPU tensors reach every other check.
:func:`check` returns what the launch needs as a :class:`Call`; :func:`plan_launch` turns it into
the instantiation, grid and arguments (what the CPU tests inspect).
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np
import torch

from ports import _alloc, _cupy
from reference.vocabulary import INT32_MAX, check_dtype

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
MODULE_FP32 = _cupy.CudaModule("ports.oneflow", "fused_apply_rotary_emb.cu",
                               kernels=kernel_names(torch.float32))
MODULE_FP16 = _cupy.CudaModule("ports.oneflow", "fused_apply_rotary_emb.cu",
                               kernels=kernel_names(torch.float16))
MODULE_BF16 = _cupy.CudaModule("ports.oneflow", "fused_apply_rotary_emb.cu",
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
class Call(NamedTuple):
    """Everything a launch needs, decided on the host."""

    dims: Dims
    out_dims: Dims
    out_shape: tuple[int, ...]
    rotary_size: int
    rotary_emb_dim: int
    table_stride: int
    device: int


def check(x, cos, sin, position_ids, x_layout, output_layout, mode, tensor_index, k_size, base,
          rotary_size, fp32_angle, fix_plane_table_stride, check_position_ids) -> Call:
    """The functor's and op's checks plus the port's guards, in upstream's order; device last."""
    _check_argument_types(x, x_layout, output_layout, mode, tensor_index, k_size, base,
                          rotary_size, fp32_angle, fix_plane_table_stride, check_position_ids)
    _check_functor_arguments(tensor_index, mode, k_size)
    index = 0 if tensor_index is None else int(tensor_index)
    dims = parse_dims(tuple(x.shape), x_layout, None if k_size is None else int(k_size), index)
    _check_rotary_size(rotary_size, dims.k)
    emb_dim = 1 if position_ids is None else _check_position_ids(position_ids, dims.b, dims.m)
    rot = dims.k if rotary_size is None else int(rotary_size)
    _check_rotary_width(rot, emb_dim, dims.k)
    table_stride = dims.k
    if (cos is None) != (sin is None):
        raise ValueError("cos & sin should both be given or not given.")
    if cos is not None:
        table_stride = _check_tables(x, cos, sin, position_ids, mode, dims, rot // emb_dim,
                                     fix_plane_table_stride, check_position_ids)
    out_layout = x_layout if output_layout is None else output_layout
    out_shape = layout_to_shape(dims.b, dims.m, dims.h, dims.k, out_layout)
    out_dims = parse_dims(out_shape, out_layout, dims.k, 0, "output")
    _cupy.check_contiguous(x, "x")
    extra = [(n, t) for n, t in (("cos", cos), ("sin", sin), ("position_ids", position_ids))
             if t is not None]
    device = _cupy.check_cuda(("x", x), *extra)
    return Call(dims, out_dims, out_shape, rot, emb_dim, table_stride, device)


def _is_int(v) -> bool:
    return isinstance(v, (numbers.Integral, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_argument_types(x, x_layout, output_layout, mode, tensor_index, k_size, base,
                          rotary_size, fp32_angle, fix_plane_table_stride,
                          check_position_ids) -> None:
    """x a tensor of a supported dtype; flags bools, layouts and mode strs, sizes ints or None,
    base a real number."""
    _cupy.check_tensor(x, "x")
    check_dtype(x, "x", _CTYPE)
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
        if value is not None and not _is_int(value):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if isinstance(base, (bool, np.bool_)) or not isinstance(base, numbers.Real):
        raise TypeError(f"base must be a float, got {type(base).__name__}")


def _check_functor_arguments(tensor_index, mode, k_size) -> None:
    """``FusedApplyRotaryEmbFunctor``'s checks of the scalar arguments (k_size > 0 added)."""
    if tensor_index is not None and not 0 <= tensor_index <= 2:
        raise ValueError(f"tensor_index should be set between [0, 2], got {tensor_index}")
    if mode not in MODES:
        raise ValueError(f'mode should be "intervel" or "plane", got {mode!r}')
    if k_size is not None and k_size <= 0:
        raise ValueError(f"k_size must be positive, got {k_size}")


def _check_rotary_size(rotary_size, k: int) -> None:
    """``0 < rotary_size <= K`` when given (upstream checks only the upper bound)."""
    if rotary_size is not None:
        if rotary_size > k:
            raise ValueError(f"rotary_size should be no more than k (rotary_size={rotary_size}, "
                             f"k={k})")
        if rotary_size <= 0:
            raise ValueError(f"rotary_size must be positive, got {rotary_size}")


def _check_position_ids(position_ids, b: int, m: int) -> int:
    """int32/int64 ``[B, E, M]`` with ``E`` 1 or 2, dense; returns ``E`` (the number of rotary
    sections)."""
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
    return emb_dim


def _check_rotary_width(rot: int, emb_dim: int, k: int) -> None:
    """R a multiple of ``2 * E`` (upstream checks ``(R // E) % 2 == 0`` only, which lets an odd
    R with E = 2 through, misaligned); K even (an odd K misaligns the unchecked pack-of-2
    fallback, and plane mode would skip the last element)."""
    if rot % (2 * emb_dim):
        raise ValueError(f"k ,or rotary_size if given, should be a multiple of 2 * "
                         f"rotary_encoding_dim (got {rot}, rotary_encoding_dim {emb_dim})")
    if k % 2:
        raise NotImplementedError(
            f"K must be even, got {k}: the unchecked pack-of-2 fallback would misalign and plane "
            "mode would skip the last element (upstream does not check)")


def _check_tables(x, cos, sin, position_ids, mode: str, dims: Dims, actual: int,
                  fix_plane_table_stride: bool, check_position_ids: bool) -> int:
    """cos/sin ``[rows, R/E]`` in x's dtype, dense, rows covering M (without position_ids) or
    the ids (a host check that syncs); returns the row stride the kernel reads them with.

    Plane mode reads ``cos[pos * K + kk]`` upstream: wrong rows and out-of-bounds reads whenever
    ``K != R/E``, so that is refused unless ``fix_plane_table_stride`` asks for row stride
    ``R/E`` (interval mode's stride)."""
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
    if position_ids is None and cos.shape[0] < dims.m:
        raise ValueError(f"M of cos & sin should be to no less than M of x when position_ids "
                         f"is not given (cos has {cos.shape[0]} rows, M = {dims.m})")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != x.dtype:
            raise TypeError(f"InferDataType Failed. Expected {x.dtype}, but got {t.dtype} "
                            f"({name})")
        _cupy.check_contiguous(t, name)
    table_stride = dims.k
    if mode == "plane" and dims.k != actual:
        if not fix_plane_table_stride:
            raise NotImplementedError(
                f"plane mode with given cos/sin reads them with row stride K = {dims.k} but they "
                f"have {actual} columns (rotary_size // rotary_embedding_dimension): upstream "
                "reads the wrong rows and out of bounds, so this port refuses it; pass "
                f"fix_plane_table_stride=True for row stride {actual}, or use full rotary with "
                "1-D position_ids")
        table_stride = actual
    if position_ids is not None and check_position_ids and position_ids.numel():
        lo, hi = int(position_ids.min()), int(position_ids.max())
        if lo < 0 or hi >= cos.shape[0]:
            raise ValueError(f"position_ids span [{lo}, {hi}] but cos/sin have "
                             f"{cos.shape[0]} rows (upstream would read out of bounds)")
    return table_stride


# ---- launch --------------------------------------------------------------------------------------
class Launch(NamedTuple):
    module: _cupy.CudaModule
    kernel: str
    grid: tuple[int]
    block: tuple[int]
    args: tuple
    pack_size: int
    index_bits: int


def plan_launch(x, cos, sin, position_ids, out, call: Call, mode: str, base: float,
                fp32_angle: bool) -> Launch:
    """``DispatchRotaryEmbeddingDimension`` -> ``DispatchIndex`` -> ``DispatchPackSize`` ->
    ``LaunchKernel``: the instantiation, grid and arguments of the one launch."""
    d, o = call.dims, call.out_dims
    itemsize = x.element_size()
    emb, rot = call.rotary_emb_dim, call.rotary_size
    numel = d.b * d.m * d.h * d.k
    offsets = [x.numel(), out.numel()] + [t.numel() for t in (cos, position_ids) if t is not None]
    wide = numel >= INT32_INDEX_LIMIT or max(offsets) > INT32_MAX
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


def rope(x, cos, sin, position_ids, call: Call, mode: str, base: float,
         fp32_angle: bool) -> torch.Tensor:
    """The one launch on checked inputs: a new output in ``call``'s output layout (empty inputs:
    no launch, as upstream)."""
    out = _alloc.empty(call.out_shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    launch = plan_launch(x, cos, sin, position_ids, out, call, mode, base, fp32_angle)
    _cupy.launch(launch.module, launch.kernel, call.device, launch.grid, launch.block, launch.args)
    return out
