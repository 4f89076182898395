"""Host checks and launch of the Paddle port: ``FusedRopeKernel`` / ``FusedRopeGradKernel``.

Every argument is checked on the host before any launch (a kernel that reads out of bounds
poisons the CUDA context for every later caller): types first, then q/k/v shapes, then the
sin/cos/position_ids group, and the device last, so CPU tensors reach every other check.

The launch follows the upstream launchers: a 1-D grid from ``GetGpuLaunchConfig1D``
(:func:`launch_config_1d`), one launch for q, k and v when their head counts match, two (q; then
k and v) for GQA/MQA, ``sign = +1`` forward and ``-1`` backward.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from ports import _alloc, _cupy
from reference.vocabulary import check_dtype, check_rank

VEC_SIZE = 2
PREDEFINED_BLOCK_SIZE = 512  # gpu_launch_config.h: CUDA performs best with 64..512 threads
MAX_GRID_X = 2**31 - 1

_TYPES = {  # torch dtype -> (CUDA storage type, MPType, numpy type of div_c)
    torch.float32: ("float", "float", np.float32),
    torch.float16: ("__half", "float", np.float32),
    torch.bfloat16: ("__nv_bfloat16", "float", np.float32),
    torch.float64: ("double", "double", np.float64),
}
_STYLES = ("every_two", "rotate_half")


def _kernel_name(style: str, dtype: torch.dtype) -> str:
    storage, mp, _ = _TYPES[dtype]
    return f"paddle_rope_{style}<{storage}, {mp}, {VEC_SIZE}>"


MODULE = _cupy.CudaModule(
    "ports.paddle", "fused_rope.cu",
    kernels=tuple(_kernel_name(s, d) for s in _STYLES for d in _TYPES),
)


# ---- host checks ----------------------------------------------------------------------------
def check_inputs(q, k, v, sin, cos, position_ids, use_neox_rotary_style: bool,
                 time_major: bool, rotary_emb_base: float, check_position_ids: bool) -> int:
    """Every check, before any launch; the device check last. Returns the device index."""
    named = [("q", q)] + [(n, t) for n, t in (("k", k), ("v", v)) if t is not None]
    _check_types(named, use_neox_rotary_style, time_major, rotary_emb_base)
    seq_len, batch = (q.shape[0], q.shape[1]) if time_major else (q.shape[1], q.shape[0])
    head_dim = q.shape[3]
    _check_qkv_shapes(named, use_neox_rotary_style)
    _check_table_choice(sin, cos, position_ids, use_neox_rotary_style)
    if sin is not None:
        _check_tables(q, sin, cos, position_ids, batch, seq_len, head_dim, check_position_ids)
    extra = [(n, t) for n, t in (("sin", sin), ("cos", cos), ("position_ids", position_ids))
             if t is not None]
    return _cupy.check_cuda(*named, *extra)


def _check_types(named, use_neox_rotary_style, time_major, rotary_emb_base) -> None:
    """q, k, v are tensors of q's supported dtype and rank 4; the flags are bools, the base a
    number."""
    q = named[0][1]
    for name, t in named:
        _cupy.check_tensor(t, name)
    check_dtype(q, "q", _TYPES)
    for name, t in named:
        check_rank(t, name, 4, "seq_len, batch, heads, head_dim" if time_major
                   else "batch, seq_len, heads, head_dim")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
    for flag, value in (("use_neox_rotary_style", use_neox_rotary_style),
                        ("time_major", time_major)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
    if (isinstance(rotary_emb_base, bool)
            or not isinstance(rotary_emb_base, (int, float, np.floating))):
        raise TypeError(f"rotary_emb_base must be a float, got {type(rotary_emb_base).__name__}")


def _check_qkv_shapes(named, use_neox_rotary_style) -> None:
    """head_dim even (a multiple of 4 for rotate-half); k and v shaped like q but for their head
    count (MQA/GQA: q's heads a multiple of theirs, k's equal to v's); all dense."""
    q = named[0][1]
    heads, head_dim = q.shape[2], q.shape[3]
    if head_dim % 2:
        raise ValueError(f"The head_dim of input must be a multiple of 2, got {head_dim}")
    if not use_neox_rotary_style and head_dim % 4:
        raise NotImplementedError(
            f"rotate-half (use_neox_rotary_style=False) needs head_dim % 4 == 0, got {head_dim}: "
            "the kernel picks each 2-vector's partner from its first element, so the element at "
            "head_dim/2 would read the next head (upstream does not check this)")
    for name, t in named[1:]:
        if (t.shape[0], t.shape[1], t.shape[3]) != (q.shape[0], q.shape[1], q.shape[3]):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but q has {tuple(q.shape)}: batch, seq_len "
                "and head_dim must match q's (the kernel indexes k/v with q's sizes; a different "
                "batch reads out of bounds: Paddle#74347)")
        if q.numel() and t.shape[2] == 0:
            raise ValueError(f"{name} has 0 heads (Paddle#78428: division by zero upstream)")
    kv_heads = [t.shape[2] for _, t in named[1:]]
    if any(h != heads for h in kv_heads):
        if not (heads != kv_heads[-1] and heads % kv_heads[-1] == 0):
            raise ValueError(
                "The MQA or GQA mode is entered, when the number of heads of qkv is not exactly "
                "the same two by two. This mode requires num_heads of q to be divisible by k,v. "
                f"But received num_heads of q is {heads}, num_heads of k,v is {kv_heads[-1]}")
        if len(kv_heads) == 2 and kv_heads[0] != kv_heads[1]:
            raise ValueError(f"The num_heads of k ({kv_heads[0]}) must be equal to the num_heads "
                             f"of v ({kv_heads[1]}) when v is given")
    for name, t in named:
        _cupy.check_contiguous(t, name)


def _check_table_choice(sin, cos, position_ids, use_neox_rotary_style) -> None:
    """Both sin and cos or neither; the computed path (neither) only as upstream's Python API
    allows it: interleaved, without position_ids."""
    if (sin is None) != (cos is None):
        raise ValueError("give both sin and cos, or neither (upstream silently ignores one alone "
                         "and computes both from rotary_emb_base)")
    if sin is not None:
        return
    if position_ids is not None:
        raise NotImplementedError("position_ids without sin/cos is not correctly supported "
                                  "(the kernel ignores them on the computed path)")
    if not use_neox_rotary_style:
        raise NotImplementedError("rotate_half without sin/cos is not correctly supported "
                                  "(the computed angles use the interleaved frequency layout)")


def _check_tables(q, sin, cos, position_ids, batch, seq_len, head_dim, check_position_ids):
    """sin/cos ``[rows, head_dim]`` or ``[1, rows, 1, head_dim]`` in q's dtype, dense; rows
    ``== seq_len`` without position_ids, else ``>= seq_len`` with int64 ``[batch, seq_len]``
    ids in ``[0, rows)`` (that range check reads the ids: a device sync)."""
    _cupy.check_tensor(sin, "sin")
    _cupy.check_tensor(cos, "cos")
    for name, t in (("sin", sin), ("cos", cos)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; it must be q's dtype {q.dtype} "
                            "(the kernel reads it as q's element type)")
    if sin.shape != cos.shape:
        raise ValueError(f"The dims of sin and cos must be the same. But received sin's dims is "
                         f"{tuple(sin.shape)}, cos's dims is {tuple(cos.shape)}")
    if sin.dim() not in (2, 4):
        raise ValueError(f"The dims of sin and cos is expected to be 2 or 4, but received "
                         f"{sin.dim()}")
    if sin.dim() == 4 and (sin.shape[0] != 1 or sin.shape[2] != 1):
        raise ValueError("The batch_size and num_heads of sin and cos must be 1 "
                         f"(shape [1, seq_len, 1, head_dim]), got {tuple(sin.shape)}")
    rows = sin.shape[1] if sin.dim() == 4 else sin.shape[0]
    if sin.shape[-1] != head_dim:
        raise ValueError(f"the head_dim of sin and cos ({sin.shape[-1]}) must equal q's "
                         f"({head_dim})")
    if position_ids is None:
        if rows != seq_len:
            raise ValueError(f"The seq_len of sin and cos ({rows}) must equal q's ({seq_len}) "
                             "when position_ids is not given")
    else:
        if rows < seq_len:
            raise ValueError(f"The seq_len of sin and cos ({rows}) must be >= q's ({seq_len})")
        _check_position_ids(position_ids, batch, seq_len, rows, check_position_ids)
    _cupy.check_contiguous(sin, "sin")
    _cupy.check_contiguous(cos, "cos")


def _check_position_ids(position_ids, batch, seq_len, rows, check_values) -> None:
    _cupy.check_tensor(position_ids, "position_ids")
    if position_ids.dtype != torch.int64:
        raise TypeError(f"position_ids must be int64, got {position_ids.dtype}")
    if tuple(position_ids.shape) != (batch, seq_len):
        raise ValueError(f"position_ids must have shape [batch_size, seq_len] = "
                         f"[{batch}, {seq_len}], got {tuple(position_ids.shape)}")
    _cupy.check_contiguous(position_ids, "position_ids")
    if check_values and position_ids.numel():
        lo, hi = int(position_ids.min()), int(position_ids.max())
        if lo < 0 or hi >= rows:
            raise ValueError(f"position_ids span [{lo}, {hi}] but sin/cos have {rows} rows "
                             "(upstream would read out of bounds)")


# ---- launch configuration (GetGpuLaunchConfig1D) --------------------------------------------
class LaunchConfig(NamedTuple):
    blocks: int
    threads: int


def _round_to_power_of_two(n: int) -> int:
    """``RoundToPowerOfTwo``: the next power of two >= n, clamped to [32, 1024]."""
    n = int(n)
    up = 1 if n <= 1 else 1 << (n - 1).bit_length()
    return min(1024, max(32, up))


def launch_config_1d(numel: int, vec_size: int, sm_count: int,
                     max_threads_per_block: int = 1024, max_grid_x: int = MAX_GRID_X
                     ) -> LaunchConfig:
    """Paddle's ``GetGpuLaunchConfig1D``: block size from the SM count, grid to cover ``numel``.

    ``active = numel // vec_size``; ``limit = min(512, max_threads_per_block)``; threads is
    ``pow2ceil(active / (2 * SMs))`` if that quotient is below ``limit``, else
    ``pow2ceil(active / (4 * SMs))`` if that one is, else ``limit``; then at least 64. Blocks
    cover ``ceil(numel / vec_size)`` threads, capped at the grid's x limit.

    >>> launch_config_1d(4 * 4096 * 32 * 128, 2, 132)  # bshd 4x4096x32x128 on an H100
    LaunchConfig(blocks=65536, threads=512)
    >>> launch_config_1d(64 * 32 * 128, 2, 132)  # one decode step, b = 64
    LaunchConfig(blocks=256, threads=512)
    >>> launch_config_1d(32 * 128, 2, 132)  # one decode step, b = 1
    LaunchConfig(blocks=32, threads=64)
    >>> launch_config_1d(16, 2, 132)
    LaunchConfig(blocks=1, threads=64)
    """
    if numel < 0 or vec_size < 1 or sm_count < 1:
        raise ValueError(f"bad launch request: numel={numel}, vec_size={vec_size}, "
                         f"sm_count={sm_count}")
    limit = min(PREDEFINED_BLOCK_SIZE, max_threads_per_block)
    active = numel // vec_size
    threads = limit
    if active // (sm_count * 2) < limit:
        threads = _round_to_power_of_two(active // (sm_count * 2))
    elif active // (sm_count * 4) < limit:
        threads = _round_to_power_of_two(active // (sm_count * 4))
    threads = max(64, threads)
    blocks = -(-(-(-numel // vec_size)) // threads)
    return LaunchConfig(min(blocks, max_grid_x), threads)


@functools.lru_cache(maxsize=None)
def device_limits(device_index: int) -> tuple[int, int]:
    """(SM count, max threads per block) of a CUDA device, read once."""
    props = torch.cuda.get_device_properties(device_index)
    return props.multi_processor_count, getattr(props, "max_threads_per_block", 1024)


# ---- launch ---------------------------------------------------------------------------------
def rope(xs: list[torch.Tensor], sin, cos, position_ids, *, sign: int,
         use_neox_rotary_style: bool, time_major: bool, rotary_emb_base: float,
         device: int) -> list[torch.Tensor]:
    """FusedRopeKernel (``sign=+1``) / FusedRopeGradKernel (``sign=-1``) on checked inputs:
    new outputs shaped like ``xs`` (q, then k and v if given); one launch for equal head counts,
    two for GQA."""
    q = xs[0]
    outs = [_alloc.empty_like(x) for x in xs]
    numel = q.numel()
    if numel == 0:
        return outs
    seq_len, batch = (q.shape[0], q.shape[1]) if time_major else (q.shape[1], q.shape[0])
    head_dim = q.shape[3]
    heads = [x.shape[2] for x in xs]
    style = "every_two" if use_neox_rotary_style else "rotate_half"
    name = _kernel_name(style, q.dtype)
    div_c = _TYPES[q.dtype][2](np.float32(1.0) / np.float32(head_dim))  # (MPType)(1.0f / D)
    sm_count, max_threads = device_limits(device)
    blocks, threads = launch_config_1d(numel, VEC_SIZE, sm_count, max_threads)
    if blocks * threads * VEC_SIZE < numel:  # the rotate-half non-default-base branch has no loop
        raise NotImplementedError(f"{numel} elements exceed what one 1-D grid covers")
    flag = sin is not None
    common = (_cupy.ptr(sin), _cupy.ptr(cos), _cupy.ptr(position_ids), _cupy.i32(int(flag)),
              _cupy.i32(sign), _cupy.i64(batch), _cupy.i64(seq_len))

    def go(ins, outs_, num_heads, batch_stride, seq_stride):
        ins = list(ins) + [None] * (3 - len(ins))
        outs_ = list(outs_) + [None] * (3 - len(outs_))
        args = (*(_cupy.ptr(t) for t in ins), *common, _cupy.i64(num_heads), _cupy.i64(head_dim),
                _cupy.i64(batch_stride), _cupy.i64(seq_stride),
                _cupy.i32(sum(t is not None for t in ins)), div_c, _cupy.f32(rotary_emb_base),
                *(_cupy.ptr(t) for t in outs_))
        _cupy.launch(MODULE, name, device, (blocks,), (threads,), args)

    def strides(h):  # contiguous [S, B, h, D] or [B, S, h, D]
        return (h * head_dim, batch * h * head_dim) if time_major else \
               (seq_len * h * head_dim, h * head_dim)

    if all(h == heads[0] for h in heads):
        go(xs, outs, heads[0], *strides(heads[0]))
    else:  # MQA / GQA: q alone, then k (and v) together, both on q's grid
        go(xs[:1], outs[:1], heads[0], *strides(heads[0]))
        go(xs[1:], outs[1:], heads[1], *strides(heads[1]))
    return outs
