"""Host side of the FlashInfer ``fused_qk_rmsnorm_rope`` port: the Python API's checks and output
allocation (``flashinfer/norm/__init__.py``), the binding's checks (``csrc/norm.cu``), the
launcher's frequency table and launch shape (``launchFusedQKNormRope``), then the port's added
checks (see :mod:`ports.flashinfer_port.qknorm`), then the device.
"""
from __future__ import annotations

import numpy as np
import torch

from ports import _cupy

HEAD_DIMS = (64, 128, 256)
MAX_HEADS = 32       # the kernel's shared array and 32 warps a block
OPTIONS = ("--use_fast_math",)  # FlashInfer's JIT flags


def _b(x: bool) -> str:
    return "true" if x else "false"


def kernel_name(head_dim: int, interleave: bool, output_fp8: bool, has_yarn: bool) -> str:
    return (f"fused_qk_rmsnorm_rope_kernel<{head_dim}, {_b(interleave)}, {_b(output_fp8)}, "
            f"{_b(has_yarn)}>")


MODULE = _cupy.CudaModule(
    "ports.flashinfer_port", "fused_qk_rmsnorm_rope.cu", options=OPTIONS,
    kernels=tuple(kernel_name(d, i, f, y) for d in HEAD_DIMS for i in (False, True)
                  for f in (False, True) for y in (False, True)))


def adjusted_freq(i: int, base: float, dim_size: int, factor: float, low: float,
                  high: float) -> np.float32:
    """``compute_adjusted_freq_host`` in fp32: ``base^(-2i/dim)``, YaRN-blended when
    ``factor != 1``."""
    f32 = np.float32
    freq = np.power(f32(base), f32(f32(-2.0) * f32(i)) / f32(dim_size), dtype=np.float32)
    if f32(factor) != f32(1.0):
        extrapolation, interpolation = freq, f32(freq / f32(factor))
        high_adj = f32(high)
        if abs(f32(low) - high_adj) <= f32(1e-6):
            high_adj = f32(high_adj + f32(0.001))
        linear = f32((f32(i) - f32(low)) / f32(high_adj - f32(low)))
        ramp = f32(min(max(linear, f32(0.0)), f32(1.0)))
        extrapolation_factor = f32(f32(1.0) - ramp)
        freq = f32(interpolation * f32(f32(1.0) - extrapolation_factor)
                   + extrapolation * extrapolation_factor)
    return f32(freq)


def freq_table(head_dim: int, base: float, channels: tuple[int, int, int], factor: float,
               low: float, high: float) -> np.ndarray:
    """The launcher's ``[head_dim / 2]`` fp32 table: each section's frequencies over its own
    channel count, frame then height then width."""
    out = [adjusted_freq(i, base, c, factor, low, high) for c in channels for i in range(c // 2)]
    if len(out) != head_dim // 2:
        raise ValueError(f"the channel counts {channels} give {len(out)} frequencies, not "
                         f"head_dim / 2 = {head_dim // 2}")
    return np.asarray(out, dtype=np.float32)


# Per device and parameters, as the original's per-device cache (kept alive for CUDA graphs that
# captured a pointer to one).
_TABLES: dict[tuple, torch.Tensor] = {}


def _device_table(device: torch.device, *key) -> torch.Tensor:
    table = _TABLES.get((device, *key))
    if table is None:
        table = torch.from_numpy(freq_table(*key)).to(device)
        _TABLES[(device, *key)] = table
    return table


def _int(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    return v


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def fused_qk_rmsnorm_rope(qkv, q_weight, k_weight, *, ppf, pph, ppw, num_frame_channels,
                          num_height_channels, num_width_channels, num_heads_q, num_heads_k,
                          num_heads_v, head_dim, eps=1e-6, base=10000.0, interleave=True,
                          factor=1.0, low=0.0, high=0.0, attention_factor=1.0, is_qk_norm=True,
                          output_fp8=False, output_quant_scale=1.0, v_quant_scale=1.0,
                          q_out=None, k_out=None, v_out=None):
    """See :func:`ports.flashinfer_port.qknorm.fused_qk_rmsnorm_rope`."""
    for name, t in (("qkv", qkv), ("q_weight", q_weight), ("k_weight", k_weight)):
        _cupy.check_tensor(t, name)
    ints = dict(ppf=ppf, pph=pph, ppw=ppw, num_frame_channels=num_frame_channels,
                num_height_channels=num_height_channels, num_width_channels=num_width_channels,
                num_heads_q=num_heads_q, num_heads_k=num_heads_k, num_heads_v=num_heads_v,
                head_dim=head_dim)
    for name, v in ints.items():
        _int(name, v)
    for name, v in (("eps", eps), ("base", base), ("factor", factor), ("low", low),
                    ("high", high), ("attention_factor", attention_factor),
                    ("output_quant_scale", output_quant_scale),
                    ("v_quant_scale", v_quant_scale)):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    # The Python API's checks, in its order (its first, qkv on CUDA, comes last here).
    if qkv.dtype != torch.bfloat16:
        raise TypeError(f"qkv must be bfloat16, got {qkv.dtype}")
    _cupy.check_contiguous(qkv, "qkv")
    if qkv.dim() not in (2, 3):
        raise ValueError("qkv must be 2-D [num_tokens, hidden] or 3-D [batch, seq_len, hidden], "
                         f"got shape {tuple(qkv.shape)}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be 64, 128 or 256, got {head_dim}")
    if min(num_heads_q, num_heads_k, num_heads_v) < 0:
        raise ValueError("head counts must be >= 0, got "
                         f"{(num_heads_q, num_heads_k, num_heads_v)}")
    max_heads = max(num_heads_q, num_heads_k, num_heads_v)
    if max_heads > MAX_HEADS:
        raise ValueError(f"max(num_heads_q, num_heads_k, num_heads_v) must be <= 32, got "
                         f"{max_heads}")
    channels = (num_frame_channels, num_height_channels, num_width_channels)
    if sum(channels) != head_dim:
        raise ValueError(f"num_frame_channels + num_height_channels + num_width_channels = "
                         f"{sum(channels)} must equal head_dim {head_dim}")
    if any(c % 2 or c < 0 for c in channels):
        raise ValueError(f"channel counts must be even and >= 0, got frame, height, width = "
                         f"{channels}")
    if min(ppf, pph, ppw) <= 0:
        raise ValueError(f"ppf, pph, ppw must be positive, got {(ppf, pph, ppw)}")
    seq_len = ppf * pph * ppw
    if qkv.dim() == 3 and qkv.shape[1] != seq_len:
        raise ValueError(f"qkv's seq_len {qkv.shape[1]} != ppf * pph * ppw = {seq_len}")
    if qkv.dim() == 2 and qkv.shape[0] % seq_len:
        raise ValueError(f"qkv's num_tokens {qkv.shape[0]} must be divisible by ppf * pph * ppw "
                         f"= {seq_len}")
    hidden = (num_heads_q + num_heads_k + num_heads_v) * head_dim
    if qkv.shape[-1] != hidden:  # added: the kernel reads rows of this size
        raise ValueError(f"qkv's last dim {qkv.shape[-1]} != (num_heads_q + num_heads_k + "
                         f"num_heads_v) * head_dim = {hidden}")
    out_dtype = torch.float8_e4m3fn if output_fp8 else torch.bfloat16
    if qkv.dim() == 3:
        num_tokens = qkv.shape[0] * seq_len
        shapes = [(qkv.shape[0], seq_len, h, head_dim)
                  for h in (num_heads_q, num_heads_k, num_heads_v)]
    else:
        num_tokens = qkv.shape[0]
        shapes = [(num_tokens, h, head_dim) for h in (num_heads_q, num_heads_k, num_heads_v)]
    for name, w, h in (("q_weight", q_weight, num_heads_q), ("k_weight", k_weight, num_heads_k)):
        if w.numel() != h * head_dim:
            raise ValueError(f"{name} has {w.numel()} elements != num_heads * head_dim = "
                             f"{h * head_dim}")
        if w.dtype != torch.bfloat16:
            raise TypeError(f"q_weight and k_weight must be bfloat16, got {name} {w.dtype}")
        _cupy.check_contiguous(w, name)
    outs = []
    for name, buf, shape in (("q_out", q_out, shapes[0]), ("k_out", k_out, shapes[1]),
                             ("v_out", v_out, shapes[2])):
        if buf is None:
            buf = torch.empty(shape, dtype=out_dtype, device=qkv.device)
        else:
            _cupy.check_tensor(buf, name)
            if tuple(buf.shape) != shape:
                raise ValueError(f"{name} shape {tuple(buf.shape)} != expected {shape}")
            if buf.dtype != out_dtype:
                raise TypeError(f"{name} dtype {buf.dtype} != expected {out_dtype}")
            _cupy.check_contiguous(buf, name)
            if buf.device != qkv.device:
                raise ValueError(f"{name} is on {buf.device} but qkv is on {qkv.device}")
            if _overlaps(buf, qkv):  # added: blocks would read what others already wrote
                raise ValueError(f"{name} overlaps qkv; the kernel reads qkv while it writes "
                                 f"{name}: pass a separate buffer")
        outs.append(buf)
    if _overlaps(outs[0], outs[1]) or _overlaps(outs[0], outs[2]) or _overlaps(outs[1], outs[2]):
        raise ValueError("q_out, k_out and v_out must not overlap")
    # The launcher's checks (FLASHINFER_FUSED_CHECK aborts the process; here they raise).
    if float(factor) == 1.0 and float(attention_factor) != 1.0:
        raise ValueError(f"attention_factor must be 1.0 when factor is 1.0 (YaRN off), got "
                         f"{attention_factor}")
    _cupy.check_index_fits(num_tokens, "num_tokens (the grid's x size)")
    if num_tokens == 0 or max_heads == 0:  # added: the original aborts on 0 tokens
        return tuple(outs)
    device = _cupy.check_cuda(("qkv", qkv), ("q_weight", q_weight), ("k_weight", k_weight),
                              ("q_out", outs[0]), ("k_out", outs[1]), ("v_out", outs[2]))
    per_lane = head_dim // 32
    for name, t in (("qkv", qkv), ("q_weight", q_weight), ("k_weight", k_weight)):
        _cupy.check_aligned(t, name, 2 * per_lane)
    for name, t in zip(("q_out", "k_out", "v_out"), outs):
        _cupy.check_aligned(t, name, per_lane * t.element_size())
    table = _device_table(qkv.device, head_dim, float(base), channels, float(factor), float(low),
                          float(high))
    has_yarn = float(factor) != 1.0
    name = kernel_name(head_dim, bool(interleave), bool(output_fp8), has_yarn)
    _cupy.launch(MODULE, name, device, (num_tokens, 3), (max_heads * 32, 1, 1),
                 (_cupy.ptr(qkv), _cupy.ptr(outs[0]), _cupy.ptr(outs[1]), _cupy.ptr(outs[2]),
                  _cupy.i32(num_heads_q), _cupy.i32(num_heads_k), _cupy.i32(num_heads_v),
                  _cupy.f32(eps), _cupy.ptr(q_weight), _cupy.ptr(k_weight), _cupy.ptr(table),
                  _cupy.i64(num_tokens), _cupy.i32(seq_len), _cupy.i32(ppw),
                  _cupy.i32(pph * ppw), _cupy.i32(num_frame_channels),
                  _cupy.i32(num_height_channels), _cupy.i32(num_width_channels),
                  _cupy.f32(attention_factor), bool(is_qk_norm), _cupy.f32(output_quant_scale),
                  _cupy.f32(v_quant_scale)))
    return tuple(outs)


__all__ = ["HEAD_DIMS", "MAX_HEADS", "MODULE", "adjusted_freq", "freq_table",
           "fused_qk_rmsnorm_rope", "kernel_name"]
