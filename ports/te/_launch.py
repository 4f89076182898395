"""Host checks and launch of the TE port: TE's ``fused_rope_forward`` / ``fused_rope_backward``
(``transformer_engine/pytorch/csrc/extensions/apply_rope.cpp``) and their launchers in
``fused_rope.cu``: the same arguments, output allocation (``at::empty(input.sizes())``: dense in
the input's format), grid choice and block shape.

Check order: the original's checks in its order, then the port's added checks (each refuses an
input the original would read or write out of bounds, or leave partly unwritten; see
:mod:`ports.te`), then the device.
"""
from __future__ import annotations

import torch

from ports import _alloc, _cupy
from reference.vocabulary import KERNEL_TORCH_DTYPES, check_dtype, check_rank

WARP_SIZE = 32  # THREADS_PER_WARP
MAX_GRID_YZ = 65535
FORMATS = ("sbhd", "bshd", "thd")
KERNEL_TYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
# The thd launcher switches to one block per token when the (s, b) grid has more than this many
# times as many blocks (times cp_size) and wastes at least this many.
THD_LINEAR_GRID_OVERLAUNCH = 2
THD_LINEAR_GRID_MIN_WASTED = 65536


def _kernel_names() -> tuple[str, ...]:
    return tuple(f"{kind}<{t}, {b}>" for kind in ("te_rope", "te_rope_thd_linear")
                 for t in KERNEL_TYPE.values() for b in ("false", "true"))


MODULE = _cupy.CudaModule("ports.te", "rope.cu", kernels=_kernel_names(), options=())


def _block(h: int) -> tuple[int, int, int]:
    return (WARP_SIZE, 4 if h < 16 else 8, 1)


def use_linear_grid(legacy_blocks: int, linear_blocks: int, cp_size: int) -> bool:
    """The original's heuristic: thd takes the token-linear grid when the (max_s, b) grid is both
    relatively and absolutely wasteful."""
    if linear_blocks == 0:
        return False
    ratio_ok = legacy_blocks > THD_LINEAR_GRID_OVERLAUNCH * cp_size * linear_blocks
    return ratio_ok and legacy_blocks - linear_blocks >= THD_LINEAR_GRID_MIN_WASTED


def _check_freqs(freqs: torch.Tensor) -> None:
    _cupy.check_tensor(freqs, "freqs")
    if freqs.dim() != 4:
        raise ValueError(f"expected 4D tensor (freqs [s, 1, 1, d2]), got shape {tuple(freqs.shape)}")
    if freqs.size(1) != 1 or freqs.size(2) != 1:
        raise ValueError("expected the second and third dims of the freqs tensor equal 1, got "
                         f"shape {tuple(freqs.shape)}")
    if freqs.dtype != torch.float32:
        raise TypeError(f"Dtype of the freqs tensor must be float, got {freqs.dtype}")
    # Added: the kernel reads freqs densely (row * d2 + i) whatever its strides.
    _cupy.check_contiguous(freqs, "freqs")


def _check_common(t: torch.Tensor, name: str, d2: int, d: int, interleaved: bool,
                  cp_size: int, cp_rank: int) -> None:
    if t.dtype not in KERNEL_TORCH_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; TE's dispatch takes float32, float16, "
                        "bfloat16")
    if d < d2:
        raise ValueError("expected the last dim of the input tensor equals or is greater than "
                         f"the freqs tensor (d = {d}, d2 = {d2})")
    # Added: an odd d2 pairs its last rotated element with one outside the rotated part.
    if d2 % 2 or d2 < 2:
        raise ValueError(f"the rotary width d2 = {d2} must be even and positive (pairs)")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need cp_size >= 1 and 0 <= cp_rank < cp_size, got {cp_size}, {cp_rank}")
    _cupy.check_index_fits(_cupy.max_offset(t), f"{name}'s largest element offset")
    _cupy.check_index_fits(t.numel(), f"{name}'s element count (output offsets)")


def _capturing() -> bool:
    """Inside a CUDA-graph capture, where reading device values on the host is not allowed."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_start_positions(start_positions, b: int, lengths: list[int] | None, rows: int,
                           cp_size: int) -> None:
    """Added: int32 (the kernel reads ``int*``), one per sequence, and no token's freqs row past
    the table (the original reads past ``freqs`` then). The values are read on the host (a device
    sync), except during CUDA-graph capture (``lengths`` None), where the kernel's own row bound
    applies instead."""
    if start_positions is not None:
        check_dtype(start_positions, "start_positions (the kernel reads int)", (torch.int32,))
        check_rank(start_positions, "start_positions", 1, "b")
        if start_positions.numel() < b:
            raise ValueError(f"start_positions has {start_positions.numel()} entries for {b} "
                             "sequences")
    if lengths is None:
        return
    if start_positions is None:
        if cp_size == 1 and max(lengths, default=0) > rows:
            raise ValueError(f"a sequence of {max(lengths)} tokens needs {max(lengths)} freqs rows; "
                             f"freqs has {rows} (the original would read past it, or leave "
                             "tokens unwritten)")
        return
    starts = start_positions[:b].tolist()
    if min(starts, default=0) < 0:
        raise ValueError("start_positions must be >= 0")
    last = max((s + n * cp_size for s, n in zip(starts, lengths)), default=0)
    if last > rows:
        raise ValueError(f"start_positions + sequence length reach freqs row {last - 1}; freqs has "
                         f"{rows} rows (the original would read past it)")


def _run(src, freqs, start_positions, tensor_format, interleaved, cu_seqlens, cp_size, cp_rank,
         backward: bool, name: str) -> torch.Tensor:
    _cupy.check_tensor(src, name)
    _check_freqs(freqs)
    if tensor_format not in FORMATS:
        raise ValueError(f"unknown tensor_format {tensor_format!r}; expected one of {FORMATS}")
    d2 = freqs.size(3)
    out = _alloc.empty(src.shape, dtype=src.dtype, device=src.device)
    if tensor_format == "thd":
        if src.dim() != 3:
            raise ValueError(f"expected 3D tensor ({name} [t, h, d]), got shape {tuple(src.shape)}")
        if cu_seqlens is None:
            raise ValueError("expected cu_seqlens tensor")
        _cupy.check_tensor(cu_seqlens, "cu_seqlens")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"expected 1D tensor (cu_seqlens), got shape {tuple(cu_seqlens.shape)}")
        t, h, d = src.shape
        _check_common(src, name, d2, d, interleaved, cp_size, cp_rank)
        # Added: int32 boundaries from 0 to t, non-decreasing (the kernel trusts them).
        if cu_seqlens.dtype != torch.int32:
            raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
        bounds = None if _capturing() else cu_seqlens.tolist()
        if bounds is not None and (
                len(bounds) < 2 or bounds[0] != 0 or bounds[-1] // cp_size != t
                or any(lo > hi for lo, hi in zip(bounds, bounds[1:]))):
            raise ValueError(f"cu_seqlens must rise from 0 to cp_size x the token count "
                             f"({cp_size} x {t}), got {bounds}")
        b = cu_seqlens.numel() - 1
        lengths = (None if bounds is None else
                   [(hi // cp_size) - (lo // cp_size) for lo, hi in zip(bounds, bounds[1:])])
        if cp_size > 1 and lengths is not None and any(n % 2 for n in lengths):
            raise ValueError("context parallelism needs even local sequence lengths (the "
                             f"original asserts it in the kernel), got {lengths}")
        max_s = freqs.size(0)
        _check_start_positions(start_positions, b, lengths, max_s, cp_size)
        if b > MAX_GRID_YZ:
            raise ValueError(f"{b} sequences exceed the grid's y limit {MAX_GRID_YZ}")
        strides = [_cupy.i32(x) for x in src.stride()]
        o_strides = [_cupy.i32(h * d), _cupy.i32(d), _cupy.i32(1)]
        device = _cupy.check_cuda((name, src), ("freqs", freqs), ("cu_seqlens", cu_seqlens),
                                  *((("start_positions", start_positions),)
                                    if start_positions is not None else ()))
        if t == 0 or h == 0:
            return out
        kernel_t = KERNEL_TYPE[src.dtype]
        flag = "true" if backward else "false"
        head = (_cupy.ptr(src), _cupy.ptr(cu_seqlens), _cupy.ptr(freqs),
                _cupy.i32(freqs.size(0)), _cupy.ptr(start_positions), _cupy.ptr(out), bool(interleaved),
                _cupy.i32(cp_size), _cupy.i32(cp_rank))
        shared = 2 * d2 * 4
        if use_linear_grid(max_s * b, t, cp_size):
            _cupy.launch(MODULE, f"te_rope_thd_linear<{kernel_t}, {flag}>", device, (t,),
                         _block(h), (*head, _cupy.i32(b), _cupy.i32(h), _cupy.i32(d),
                                     _cupy.i32(d2), strides[0], strides[1], strides[2],
                                     *o_strides), shared_mem=shared)
        else:
            _cupy.launch(MODULE, f"te_rope<{kernel_t}, {flag}>", device, (max_s, b), _block(h),
                         (*head, _cupy.i32(max_s), _cupy.i32(h), _cupy.i32(d), _cupy.i32(d2),
                          strides[0], _cupy.i32(0), strides[1], strides[2], o_strides[0],
                          _cupy.i32(0), o_strides[1], o_strides[2]), shared_mem=shared)
        return out

    if src.dim() != 4:
        raise ValueError(f"expected 4D tensor ({name} [{', '.join(tensor_format)}]), got shape "
                         f"{tuple(src.shape)}")
    sbhd = tensor_format == "sbhd"
    s, b = (src.size(0), src.size(1)) if sbhd else (src.size(1), src.size(0))
    h, d = src.size(2), src.size(3)
    stride_s, stride_b = (src.stride(0), src.stride(1)) if sbhd else (src.stride(1), src.stride(0))
    if s * cp_size > freqs.size(0):
        raise ValueError("expected freqs tensor has a longer sequence length than input "
                         f"(s * cp_size = {s * cp_size}, freqs has {freqs.size(0)} rows)")
    _check_common(src, name, d2, d, interleaved, cp_size, cp_rank)
    _check_start_positions(start_positions, b, None if _capturing() else [s] * b,
                           freqs.size(0), cp_size)
    if b > MAX_GRID_YZ:
        raise ValueError(f"b = {b} exceeds the grid's y limit {MAX_GRID_YZ} (grid (s, b))")
    if cp_size > 1 and s % 2:
        raise ValueError(f"context parallelism needs an even local sequence length, got {s}")
    o_stride_s, o_stride_b = (b * h * d, h * d) if sbhd else (h * d, s * h * d)
    device = _cupy.check_cuda((name, src), ("freqs", freqs),
                              *((("start_positions", start_positions),)
                                if start_positions is not None else ()))
    if out.numel() == 0:
        return out
    flag = "true" if backward else "false"
    _cupy.launch(MODULE, f"te_rope<{KERNEL_TYPE[src.dtype]}, {flag}>", device, (s, b), _block(h),
                 (_cupy.ptr(src), _cupy.ptr(None), _cupy.ptr(freqs), _cupy.i32(freqs.size(0)),
                  _cupy.ptr(start_positions),
                  _cupy.ptr(out), bool(interleaved), _cupy.i32(cp_size), _cupy.i32(cp_rank),
                  _cupy.i32(s), _cupy.i32(h), _cupy.i32(d), _cupy.i32(d2),
                  *(_cupy.i32(x) for x in (stride_s, stride_b, src.stride(2), src.stride(3),
                                           o_stride_s, o_stride_b, d, 1))),
                 shared_mem=2 * d2 * 4)
    return out


def fused_rope_forward(input: torch.Tensor, freqs: torch.Tensor, start_positions=None,
                       qkv_format: str = "sbhd", interleaved: bool = False, cu_seqlens=None,
                       cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """TE's ``fused_rope_forward``: a new tensor, dense in ``qkv_format``."""
    return _run(input, freqs, start_positions, qkv_format, interleaved, cu_seqlens, cp_size,
                cp_rank, backward=False, name="input")


def fused_rope_backward(output_grads: torch.Tensor, freqs: torch.Tensor, start_positions=None,
                        qkv_format: str = "sbhd", interleaved: bool = False, cu_seqlens=None,
                        cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """TE's ``fused_rope_backward``: the input gradient, dense in ``qkv_format``."""
    return _run(output_grads, freqs, start_positions, qkv_format, interleaved, cu_seqlens,
                cp_size, cp_rank, backward=True, name="output_grads")


__all__ = ["MODULE", "fused_rope_forward", "fused_rope_backward", "use_linear_grid"]
