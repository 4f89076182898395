"""Host checks and launch of the apex port: apex's ``fused_rotary_positional_embedding`` extension.

apex builds a pybind extension of that name with eight functions (``forward``, ``backward``,
``forward_cached``, ``backward_cached``, ``forward_thd``, ``backward_thd``, ``forward_2d``,
``backward_2d``): each checks its arguments (``TORCH_CHECK`` in the ``.cpp``), allocates a fresh
output (``.cu`` host code) and launches one kernel of ``rope.cu``. This module is that layer, with
the same names, arguments, output allocation and launch shape; :mod:`ports.apex` holds the
autograd functions above it (and exports this module under apex's name,
``fused_rotary_positional_embedding``).

Check order: the original's checks in the original's order (ranks, sizes, dtypes), then the
port's added checks (dense tables, even rotary width, int32 offsets, grid limits, cu_seqlens
values), then the device, last: a launch with bad arguments could fault and poison the CUDA
context, so nothing reaches the kernel unchecked.
"""
from __future__ import annotations

import numpy as np
import torch

from ports import _alloc, _cupy
from reference.vocabulary import KERNEL_TORCH_DTYPES

WARP_SIZE = 32  # at::cuda::warp_size() on NVIDIA GPUs
MAX_GRID_YZ = 65535  # gridDim.y / gridDim.z limit (b for sbhd and thd; iw and b for 2-D)

INPUT_DTYPES = KERNEL_TORCH_DTYPES
# The kernel's type for each torch dtype (bf16 / fp16 emulate c10::BFloat16 / c10::Half).
KERNEL_TYPE = {torch.float32: "float", torch.float16: "ApexHalf", torch.bfloat16: "ApexBFloat16"}
# (input, cos/sin) dtype pairs the original's DISPATCH_FUSED_ROPE_TYPES instantiates.
TABLE_PAIRS = (
    (torch.float32, torch.float32),
    (torch.float16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
)


def _kernel_names() -> tuple[str, ...]:
    names = [f"apex_rope_{kind}<{KERNEL_TYPE[t]}>" for kind in ("fwd", "bwd", "thd_fwd", "thd_bwd")
             for t in INPUT_DTYPES]
    names += [f"apex_rope_{kind}<{KERNEL_TYPE[t]}, {KERNEL_TYPE[c]}>"
              for kind in ("cached_fwd", "cached_bwd", "2d_fwd", "2d_bwd") for t, c in TABLE_PAIRS]
    return tuple(names)


# No --use_fast_math: apex's setup.py does not pass it (GPT-NeoX's build of the same source does).
# apex's -U__CUDA_NO_HALF_OPERATORS__ / -U__CUDA_NO_HALF_CONVERSIONS__ have no counterpart: the
# kernels use their own c10-style types, not cuda_fp16's operators. NVRTC optimises by default.
MODULE = _cupy.CudaModule("ports.apex", "rope.cu", kernels=_kernel_names(), options=())


# ---- checks --------------------------------------------------------------------------------------
def _scalar_name(dtype: torch.dtype) -> str:
    """ATen's toString(ScalarType), as the original's messages print it."""
    names = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
             torch.float64: "Double", torch.int32: "Int", torch.int64: "Long"}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def _require(ok: bool, message, exc: type[Exception] = ValueError) -> None:
    """Raise ``exc(message())`` unless ``ok``; the message is built only on failure (the checks
    run on every call, and formatting shapes costs host time). ``message`` is called at once, so
    a lambda written inside a loop sees that iteration's variables."""
    if not ok:
        raise exc(message())


def _check_tensors(**named) -> None:
    for name, t in named.items():
        _cupy.check_tensor(t, name)


def _check_input_dtype(t: torch.Tensor, name: str, op: str) -> None:
    # DISPATCH_FLOAT_HALF_AND_BFLOAT (type_shim.h): "<op> not implemented for '<type>'".
    _require(t.dtype in INPUT_DTYPES,
             lambda: f"{op} not implemented for '{_scalar_name(t.dtype)}' ({name} must be float32, "
             "float16 or bfloat16)", TypeError)


def _check_table_pair(t: torch.Tensor, table: torch.Tensor, op: str) -> None:
    # DISPATCH_FUSED_ROPE_TYPES: "<op> not supported for '<T1>' with '<T2>'".
    _require((t.dtype, table.dtype) in TABLE_PAIRS,
             lambda: f"{op} not supported for '{_scalar_name(t.dtype)}' with "
             f"'{_scalar_name(table.dtype)}' (cos/sin must be float32 or the input's dtype)",
             TypeError)


def _check_freqs(t: torch.Tensor, freqs: torch.Tensor, name: str, op: str) -> None:
    """The freqs paths' checks after the ranks: ``freqs`` is ``[rows, 1, 1, d2]`` fp32 with
    ``d2`` at most t's last dim (``d``), and t's dtype is one the kernels take."""
    _require(freqs.size(1) == 1 and freqs.size(2) == 1,
             lambda: f"expected the second and third dims of the freqs tensor equal 1, got shape "
             f"{tuple(freqs.shape)}")
    _require(t.size(-1) >= freqs.size(3),
             lambda: f"expected the last dim of the {name} tensor equals or is greater than "
             f"the freqs tensor ({t.size(-1)} < {freqs.size(3)})")
    _require(freqs.dtype == torch.float32,
             lambda: f"Dtype of the freqs tensor must be float, got {_scalar_name(freqs.dtype)}",
             TypeError)
    _check_input_dtype(t, name, op)


def _check_dense(**tables) -> None:
    # Added: the kernel reads tables as dense [rows, d2]; the original never checks it.
    for name, t in tables.items():
        _cupy.check_contiguous(t, name)


def _check_even(width: int, what: str, multiple: int = 2) -> None:
    # Added: an odd rotated width pairs elements wrongly (the original does not check).
    _require(width % multiple == 0,
             lambda: f"{what} must be a multiple of {multiple} (rotate-half pairs j with "
             f"j + width/2), got {width}")


def _check_int32(out_numel: int, **tensors) -> None:
    """Added: every offset the kernel forms (into the inputs, tables and the new contiguous-memory
    output of ``out_numel`` elements) must fit its int32 index math."""
    for name, t in tensors.items():
        _cupy.check_index_fits(_cupy.max_offset(t), f"the largest element offset of {name}")
    _cupy.check_index_fits(max(out_numel - 1, 0), "the largest element offset of the output")


def _check_grid(value: int, what: str) -> None:
    _require(value <= MAX_GRID_YZ,
             lambda: f"{what} = {value} exceeds the grid's y/z limit {MAX_GRID_YZ} (one block "
             "per token)",
             NotImplementedError)


def _device(**tensors) -> int:
    return _cupy.check_cuda(*tensors.items())


def _strides(t: torch.Tensor) -> list[int]:
    # A size-1 axis is only ever indexed at 0, so its stride is irrelevant; pass 0 so that an
    # arbitrary stride there (from slicing) does not have to fit an int.
    return [st if n > 1 else 0 for n, st in zip(t.shape, t.stride())]


def _block(h: int) -> tuple[int, int]:
    return (WARP_SIZE, 4 if h < 16 else 8)


def _i32s(values) -> tuple:
    # Every value is a size or a stride of a checked tensor: _check_int32 has bounded them all by
    # 2^31 - 1 already, so plain np.int32 (no per-value range check) is safe here.
    return tuple(map(np.int32, values))


# ---- sbhd: freqs (fp32 angles) -------------------------------------------------------------------
def _check_freqs_sbhd(t: torch.Tensor, freqs: torch.Tensor, name: str, op: str) -> None:
    _check_tensors(**{name: t, "freqs": freqs})
    _require(t.dim() == 4, lambda: f"expected 4D tensor: {name} must be [s, b, h, d], got shape "
                           f"{tuple(t.shape)}")
    _require(freqs.dim() == 4, lambda: f"expected 4D tensor: freqs must be [s, 1, 1, d2], got "
                               f"shape {tuple(freqs.shape)}")
    _require(t.size(0) == freqs.size(0),
             lambda: f"expected {name} and freqs tensor have the same sequence length "
             f"({t.size(0)} vs {freqs.size(0)})")
    _check_freqs(t, freqs, name, op)


def _alloc_sbhd(t: torch.Tensor, transpose_output: bool) -> torch.Tensor:
    s, b, h, d = t.shape
    if transpose_output:  # logical [s, b, h, d], memory [b, s, h, d]
        return _alloc.empty((b, s, h, d), dtype=t.dtype, device=t.device).transpose(0, 1)
    return _alloc.empty((s, b, h, d), dtype=t.dtype, device=t.device)


def _run_sbhd(kernel: str, t: torch.Tensor, tables: dict[str, torch.Tensor], d2: int,
              transpose_output: bool, name: str) -> torch.Tensor:
    _check_int32(t.numel(), **{name: t}, **tables)
    device = _device(**{name: t}, **tables)
    out = _alloc_sbhd(t, bool(transpose_output))
    if out.numel() == 0:
        return out  # added: the original would launch an empty grid and raise
    s, b, h, d = t.shape
    args = _i32s([h, d, d2, *_strides(t), *_strides(out)])
    _cupy.launch(MODULE, kernel, device, (s, b), _block(h),
                 (*args, _cupy.ptr(t), *(_cupy.ptr(x) for x in tables.values()), _cupy.ptr(out)))
    return out


def _sbhd_freqs(direction: str, t: torch.Tensor, freqs: torch.Tensor, transpose_output: bool,
                name: str) -> torch.Tensor:
    op = f"dispatch_fused_rope_{direction}"
    _check_freqs_sbhd(t, freqs, name, op)
    d2 = freqs.size(3)
    _check_dense(freqs=freqs)
    _check_even(d2, "freqs.size(3) (d2)")
    _check_grid(t.size(1), "b")
    kernel = f"apex_rope_{'fwd' if direction == 'forward' else 'bwd'}<{KERNEL_TYPE[t.dtype]}>"
    return _run_sbhd(kernel, t, {"freqs": freqs}, d2, transpose_output, name)


def forward(input: torch.Tensor, freqs: torch.Tensor, transpose_output: bool) -> torch.Tensor:
    """RoPE of ``input`` [s, b, h, d] (any strides) with fp32 angles ``freqs`` [s, 1, 1, d2].

    Returns a new [s, b, h, d] tensor; with ``transpose_output`` its memory is [b, s, h, d].
    """
    return _sbhd_freqs("forward", input, freqs, transpose_output, "input")


def backward(output_grads: torch.Tensor, freqs: torch.Tensor, transpose_output: bool
             ) -> torch.Tensor:
    """Input gradient of :func:`forward` (the exact transpose, with each partner's sine)."""
    return _sbhd_freqs("backward", output_grads, freqs, transpose_output, "output_grads")


# ---- sbhd: cached cos / sin ----------------------------------------------------------------------
def _check_cached_sbhd(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, name: str,
                       op: str) -> None:
    _check_tensors(**{name: t, "cos": cos, "sin": sin})
    for what, x, dims in ((name, t, "s, b, h, d"), ("cos", cos, "s, 1, 1, d2"),
                          ("sin", sin, "s, 1, 1, d2")):
        _require(x.dim() == 4, lambda: f"expected 4D tensor: {what} must be [{dims}], got shape "
                               f"{tuple(x.shape)}")
    for what, x in (("cos", cos), ("sin", sin)):
        _require(t.size(0) == x.size(0),
                 lambda: f"expected {name} and {what} tensor have the same sequence length "
                 f"({t.size(0)} vs {x.size(0)})")
    for what, x in (("cos", cos), ("sin", sin)):
        _require(x.size(1) == 1 and x.size(2) == 1,
                 lambda: f"expected the second and third dims of the {what} tensor equal 1, got "
                 f"shape {tuple(x.shape)}")
    _require(cos.size(3) == sin.size(3),
             lambda: f"expected cos and sin tensor have the same last dim ({cos.size(3)} vs "
             f"{sin.size(3)})")
    _require(t.size(3) >= cos.size(3),
             lambda: f"expected the last dim of the {name} tensor equals or is greater than "
             f"the cos tensor ({t.size(3)} < {cos.size(3)})")
    _require(cos.dtype == sin.dtype,
             lambda: f"expected cos and sin tensor have the same dtype "
             f"({_scalar_name(cos.dtype)} vs {_scalar_name(sin.dtype)})", TypeError)
    _check_table_pair(t, cos, op)


def _sbhd_cached(direction: str, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 transpose_output: bool, name: str) -> torch.Tensor:
    _check_cached_sbhd(t, cos, sin, name, f"dispatch_fused_rope_cached_{direction}")
    d2 = cos.size(3)
    _check_dense(cos=cos, sin=sin)
    _check_even(d2, "cos.size(3) (d2)")
    _check_grid(t.size(1), "b")
    kind = "cached_fwd" if direction == "forward" else "cached_bwd"
    kernel = f"apex_rope_{kind}<{KERNEL_TYPE[t.dtype]}, {KERNEL_TYPE[cos.dtype]}>"
    return _run_sbhd(kernel, t, {"cos": cos, "sin": sin}, d2, transpose_output, name)


def forward_cached(input: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   transpose_output: bool) -> torch.Tensor:
    """RoPE of ``input`` [s, b, h, d] with given ``cos``/``sin`` [s, 1, 1, d2] (fp32 or input's
    dtype; rounded to the input's dtype in the kernel)."""
    return _sbhd_cached("forward", input, cos, sin, transpose_output, "input")


def backward_cached(output_grads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    transpose_output: bool) -> torch.Tensor:
    """Input gradient of :func:`forward_cached` (exact for any cos/sin: partner's sine)."""
    return _sbhd_cached("backward", output_grads, cos, sin, transpose_output, "output_grads")


# ---- thd -----------------------------------------------------------------------------------------
def _check_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, name: str,
               op: str) -> None:
    _check_tensors(**{name: t, "cu_seqlens": cu_seqlens, "freqs": freqs})
    _require(t.dim() == 3, lambda: f"expected 3D tensor: {name} must be [t, h, d], got shape "
                           f"{tuple(t.shape)}")
    _require(cu_seqlens.dim() == 1, lambda: f"expected 1D tensor: cu_seqlens must be [b + 1], "
                                    f"got shape {tuple(cu_seqlens.shape)}")
    _require(freqs.dim() == 4, lambda: f"expected 4D tensor: freqs must be [max_s, 1, 1, d2], "
                               f"got shape {tuple(freqs.shape)}")
    _check_freqs(t, freqs, name, op)
    # Added: the original reads cu_seqlens with data_ptr<int>() (which throws for other dtypes).
    _require(cu_seqlens.dtype == torch.int32,
             lambda: f"cu_seqlens must be int32, got {_scalar_name(cu_seqlens.dtype)}", TypeError)
    _require(cu_seqlens.numel() >= 1,
             lambda: "cu_seqlens must hold at least one entry (b + 1 >= 1)")
    _check_dense(freqs=freqs)
    _check_even(freqs.size(3), "freqs.size(3) (d2)")
    _check_grid(cu_seqlens.numel() - 1, "b (len(cu_seqlens) - 1)")


def validate_cu_seqlens(cu_seqlens: torch.Tensor, total: int, max_s: int) -> tuple[int, int]:
    """Added: check the values of ``cu_seqlens`` that the original trusts; returns the packed
    token range ``[cu_seqlens[0], cu_seqlens[-1])`` the kernel writes.

    Reading the values is a device-to-host copy, which synchronises with the current stream.
    Raises ``ValueError`` unless ``0 <= cu[0] <= cu[1] <= ... <= cu[-1] <= total`` and every
    sequence length ``cu[i+1] - cu[i] <= max_s`` (the original leaves tokens past ``max_s``
    unwritten, and reads / writes out of bounds for the others).
    """
    cu = cu_seqlens.tolist()  # the sync
    if cu[0] < 0:
        raise ValueError(f"cu_seqlens[0] must be >= 0, got {cu[0]}")
    for i in range(len(cu) - 1):
        length = cu[i + 1] - cu[i]
        if length < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{i + 1}] = "
                             f"{cu[i + 1]} < cu_seqlens[{i}] = {cu[i]}")
        if length > max_s:
            raise ValueError(f"sequence {i} has {length} tokens but freqs has max_s = {max_s} "
                             "rows (the original would leave the rest unwritten)")
    if cu[-1] > total:
        raise ValueError(f"cu_seqlens[-1] = {cu[-1]} exceeds the {total} packed tokens of the "
                         "input (out-of-bounds access in the original)")
    return cu[0], cu[-1]


def _run_thd(direction: str, t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
             covered: tuple[int, int], name: str) -> torch.Tensor:
    _check_int32(t.numel(), **{name: t, "freqs": freqs})
    device = _device(**{name: t, "cu_seqlens": cu_seqlens, "freqs": freqs})
    total, h, d = t.shape
    out = _alloc.empty((total, h, d), dtype=t.dtype, device=t.device)
    first, last = covered
    # Added: rows outside [cu[0], cu[-1]) are never visited by the kernel; the original returns
    # them uninitialised (torch::empty). Zero them (nothing else is left unwritten: lengths are
    # <= max_s, checked above).
    if first > 0:
        out[:first].zero_()
    if last < total:
        out[last:].zero_()
    b, max_s, d2 = cu_seqlens.numel() - 1, freqs.size(0), freqs.size(3)
    if out.numel() == 0 or b == 0 or max_s == 0:
        return out
    kind = "thd_fwd" if direction == "forward" else "thd_bwd"
    args = _i32s([h, d, d2, *_strides(t), *_strides(out)])
    _cupy.launch(MODULE, f"apex_rope_{kind}<{KERNEL_TYPE[t.dtype]}>", device, (max_s, b),
                 _block(h), (*args, _cupy.ptr(t), _cupy.ptr(cu_seqlens), _cupy.ptr(freqs),
                             _cupy.ptr(out)))
    return out


def rope_thd(direction: str, t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
             name: str, covered: tuple[int, int] | None = None
             ) -> tuple[torch.Tensor, tuple[int, int]]:
    """``forward_thd`` / ``backward_thd`` (``direction``), returning the output and the token
    range ``[cu_seqlens[0], cu_seqlens[-1])`` it covers. ``covered`` from an earlier call with the
    same ``cu_seqlens`` skips the value check (and its sync): the autograd backward passes the
    forward's."""
    _check_thd(t, cu_seqlens, freqs, name, f"dispatch_fused_rope_thd_{direction}")
    if covered is None:
        covered = validate_cu_seqlens(cu_seqlens, t.size(0), freqs.size(0))
    return _run_thd(direction, t, cu_seqlens, freqs, covered, name), covered


def forward_thd(input: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor
                ) -> torch.Tensor:
    """RoPE of packed ``input`` [t, h, d] (any strides); ``cu_seqlens`` [b + 1] int32 (CUDA);
    ``freqs`` [max_s, 1, 1, d2] fp32 angles, row = position inside each sequence.

    Validates ``cu_seqlens`` on the host (one device-to-host copy: a stream sync).
    """
    return rope_thd("forward", input, cu_seqlens, freqs, "input")[0]


def backward_thd(output_grads: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor
                 ) -> torch.Tensor:
    """Input gradient of :func:`forward_thd` (validates ``cu_seqlens`` too: a stream sync)."""
    return rope_thd("backward", output_grads, cu_seqlens, freqs, "output_grads")[0]


# ---- 2-D -----------------------------------------------------------------------------------------
def check_2d_view(t: torch.Tensor, img_h: int, img_w: int, cos_h: torch.Tensor,
                  sin_h: torch.Tensor, cos_w: torch.Tensor, sin_w: torch.Tensor) -> None:
    """The checks of apex's Python 2-D wrapper (``assert``s there, ``ValueError`` here, since
    ``assert`` vanishes under ``-O``), plus ``t``'s rank before it is viewed as
    ``[b, img_h, img_w, h, d]``."""
    _check_tensors(t=t, cos_h=cos_h, sin_h=sin_h, cos_w=cos_w, sin_w=sin_w)
    if t.dim() != 4:
        raise ValueError(f"expected t to be 4D tensor [b, s, h, d], got shape {tuple(t.shape)}")
    if t.size(1) != img_h * img_w:
        raise ValueError(f"The sequence length should be equal to img_h * img_w ({t.size(1)} vs "
                         f"{img_h} * {img_w})")
    if cos_h.size() != sin_h.size():
        raise ValueError(f"The shape of cos_h and sin_h should be the same ({tuple(cos_h.shape)} "
                         f"vs {tuple(sin_h.shape)})")
    if cos_w.size() != sin_w.size():
        raise ValueError(f"The shape of cos_w and sin_w should be the same ({tuple(cos_w.shape)} "
                         f"vs {tuple(sin_w.shape)})")


def _check_2d(t: torch.Tensor, tables: dict[str, torch.Tensor], name: str, op: str) -> None:
    """The ``.cpp``'s 2-D checks, then the port's: ``t`` is ``[b, ih, iw, h, d]``, ``tables``
    are ``cos_h``, ``sin_h``, ``cos_w``, ``sin_w`` (``[1, H >= ih | W >= iw, 1, d/2]``)."""
    _check_tensors(**{name: t}, **tables)
    _require(t.dim() == 5, lambda: f"expected {name} to be 5D tensor [b, ih, iw, h, d], got shape "
                           f"{tuple(t.shape)}")
    for what, x in tables.items():
        _require(x.dim() == 4,
                 lambda: f"expected {what} to be 4D tensor, got shape {tuple(x.shape)}")
    b, ih, iw, _, d = t.shape
    cos_h, sin_h, cos_w, sin_w = tables.values()
    for axis, size, cos in (("h", ih, cos_h), ("w", iw, cos_w)):
        _require(cos.size(2) == 1, lambda: f"expected third dim of cos_{axis}/sin_{axis} equals "
                                   f"1, got shape {tuple(cos.shape)}")
        where = "height" if axis == "h" else "width"
        _require(size <= cos.size(1), lambda: f"expected {name}'s {where} <= "
                                      f"cos_{axis}/sin_{axis}'s ({size} > {cos.size(1)})")
        _require(d // 2 == cos.size(3), lambda: f"expected cos_{axis}/sin_{axis}'s head dim equals "
                                        f"{name}'s head dim / 2 ({cos.size(3)} vs {d} / 2)")
    _check_table_pair(t, cos_h, op)
    # Added (the original checks these in the Python wrapper only, or not at all: a mismatch
    # throws inside data_ptr<T>() or reads the wrong rows).
    for axis, cos, sin in (("h", cos_h, sin_h), ("w", cos_w, sin_w)):
        _require(sin.shape == cos.shape, lambda: f"The shape of cos_{axis} and sin_{axis} should "
                                         f"be the same ({tuple(cos.shape)} vs {tuple(sin.shape)})")
    for what, x in (("sin_h", sin_h), ("cos_w", cos_w), ("sin_w", sin_w)):
        _require(x.dtype == cos_h.dtype, lambda: f"{what} has dtype {_scalar_name(x.dtype)} but "
                                         f"cos_h has {_scalar_name(cos_h.dtype)}; all four must "
                                         "match",
                 TypeError)
    _check_dense(**tables)
    _check_even(d, f"{name}'s head dim d (two rotate-half sections of width d/2)", 4)
    _check_grid(iw, "iw (image width)")
    _check_grid(b, "b")
    _check_int32(t.numel(), **{name: t}, **tables)


def _two_d(direction: str, t: torch.Tensor, cos_h, sin_h, cos_w, sin_w, name: str
           ) -> torch.Tensor:
    tables = dict(cos_h=cos_h, sin_h=sin_h, cos_w=cos_w, sin_w=sin_w)
    _check_2d(t, tables, name, f"dispatch_fused_rope_2d_{direction}")
    device = _device(**{name: t}, **tables)
    b, ih, iw, h, d = t.shape
    out = _alloc.empty((b, ih * iw, h, d), dtype=t.dtype, device=t.device)
    if out.numel() == 0:
        return out
    kind = "2d_fwd" if direction == "forward" else "2d_bwd"
    kernel = f"apex_rope_{kind}<{KERNEL_TYPE[t.dtype]}, {KERNEL_TYPE[cos_h.dtype]}>"
    args = _i32s([ih, iw, h, d, *_strides(t), *_strides(out)])
    _cupy.launch(MODULE, kernel, device, (ih, iw, b), _block(h),
                 (*args, *(_cupy.ptr(x) for x in (t, cos_h, sin_h, cos_w, sin_w)),
                  _cupy.ptr(out)))
    return out


def forward_2d(input: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor,
               cos_w: torch.Tensor, sin_w: torch.Tensor) -> torch.Tensor:
    """2-D RoPE of ``input`` [b, ih, iw, h, d] (any strides) -> new [b, ih*iw, h, d].

    ``cos_h``/``sin_h`` [1, H >= ih, 1, d/2], ``cos_w``/``sin_w`` [1, W >= iw, 1, d/2].
    """
    return _two_d("forward", input, cos_h, sin_h, cos_w, sin_w, "input")


def backward_2d(output_grads: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor,
                cos_w: torch.Tensor, sin_w: torch.Tensor) -> torch.Tensor:
    """Input gradient of :func:`forward_2d`: ``output_grads`` [b, ih, iw, h, d] -> new
    [b, ih*iw, h, d]."""
    return _two_d("backward", output_grads, cos_h, sin_h, cos_w, sin_w, "output_grads")


__all__ = ["MODULE", "forward", "backward", "forward_cached", "backward_cached", "forward_thd",
           "backward_thd", "forward_2d", "backward_2d", "validate_cu_seqlens", "rope_thd",
           "check_2d_view"]
