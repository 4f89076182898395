"""PaddlePaddle's ``fused_rotary_position_embedding``, V1 vectorized kernels, on CuPy RawKernels.

Upstream (Apache-2.0), re-implemented from the design rather than copied:

* ``PaddlePaddle/Paddle@09d06946d919bc338915788c5bbae50c0db44458:paddle/phi/kernels/fusion/gpu/fused_rope_utils.h``
  (the kernels, ported in ``fused_rope.cu``)
* ``PaddlePaddle/Paddle@e5b22f5e43e73e2224a5f0c2c9d254ecd280273a:paddle/phi/kernels/fusion/gpu/fused_rope_kernel.cu``
  (forward launcher, :func:`_launch` with ``sign=+1``)
* ``PaddlePaddle/Paddle@5f908167fd1e694ef700a7aae2b488653debd8aa:paddle/phi/kernels/fusion/gpu/fused_rope_grad_kernel.cu``
  (backward launcher, ``sign=-1``)
* ``PaddlePaddle/Paddle@09d06946d919bc338915788c5bbae50c0db44458:python/paddle/incubate/nn/functional/fused_rotary_position_embedding.py``
  (the public API)
* ``PaddlePaddle/Paddle:paddle/phi/backends/gpu/gpu_launch_config.h`` (``GetGpuLaunchConfig1D``,
  :func:`launch_config_1d`)

**Naming trap** (kept from upstream): ``use_neox_rotary_style=True`` (the default) selects the
*every-two / interleaved* (GPT-J) pairing ``(2i, 2i+1)``; ``use_neox_rotary_style=False`` selects
*rotate-half* (NeoX / HF-Llama) pairs ``(i, i + D/2)``. Upstream's docstring: "When
use_neox_rotary_style is True, every two adjacent numbers are calculated".

Design kept: a 1-D elementwise grid sized by ``GetGpuLaunchConfig1D(numel(q), vec_size=2)``
(block size from the SM count), a grid-stride loop of two elements per thread, int64 index math,
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
    element; with ``D % 4 == 2`` the element at ``D/2`` reads the next head): ``NotImplementedError``;
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

import functools
from typing import NamedTuple

import numpy as np
import torch

from ports import _alloc, _cupy

VEC_SIZE = 2
PREDEFINED_BLOCK_SIZE = 512  # gpu_launch_config.h: CUDA performs best with 64..512 threads
MAX_GRID_X = 2**31 - 1
DEFAULT_ROTARY_BASE = 10000.0

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
    __name__, "fused_rope.cu",
    kernels=tuple(_kernel_name(s, d) for s in _STYLES for d in _TYPES),
)


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
def _device_limits(device_index: int) -> tuple[int, int]:
    """(SM count, max threads per block) of a CUDA device, read once."""
    props = torch.cuda.get_device_properties(device_index)
    return props.multi_processor_count, getattr(props, "max_threads_per_block", 1024)


# ---- host checks ----------------------------------------------------------------------------
def _check_inputs(q, k, v, sin, cos, position_ids, use_neox_rotary_style: bool,
                  time_major: bool, rotary_emb_base: float, check_position_ids: bool):
    """Every check, before any launch; the device check last. Returns the device index."""
    named = [("q", q)] + [(n, t) for n, t in (("k", k), ("v", v)) if t is not None]
    for name, t in named:
        _cupy.check_tensor(t, name)
    _cupy.check_dtype(q, "q", _TYPES)
    for name, t in named:
        _cupy.check_rank(t, name, 4, "seq_len, batch, heads, head_dim" if time_major
                         else "batch, seq_len, heads, head_dim")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
    for flag, value in (("use_neox_rotary_style", use_neox_rotary_style),
                        ("time_major", time_major)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
    if isinstance(rotary_emb_base, bool) or not isinstance(rotary_emb_base, (int, float, np.floating)):
        raise TypeError(f"rotary_emb_base must be a float, got {type(rotary_emb_base).__name__}")

    seq_len, batch = (q.shape[0], q.shape[1]) if time_major else (q.shape[1], q.shape[0])
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

    if (sin is None) != (cos is None):
        raise ValueError("give both sin and cos, or neither (upstream silently ignores one alone "
                         "and computes both from rotary_emb_base)")
    if sin is None:
        if position_ids is not None:
            raise NotImplementedError("position_ids without sin/cos is not correctly supported "
                                      "(the kernel ignores them on the computed path)")
        if not use_neox_rotary_style:
            raise NotImplementedError("rotate_half without sin/cos is not correctly supported "
                                      "(the computed angles use the interleaved frequency layout)")
    else:
        _check_tables(q, sin, cos, position_ids, batch, seq_len, head_dim, check_position_ids)
    extra = [(n, t) for n, t in (("sin", sin), ("cos", cos), ("position_ids", position_ids))
             if t is not None]
    return _cupy.check_cuda(*named, *extra)


def _check_tables(q, sin, cos, position_ids, batch, seq_len, head_dim, check_position_ids):
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
        _cupy.check_tensor(position_ids, "position_ids")
        if position_ids.dtype != torch.int64:
            raise TypeError(f"position_ids must be int64, got {position_ids.dtype}")
        if tuple(position_ids.shape) != (batch, seq_len):
            raise ValueError(f"position_ids must have shape [batch_size, seq_len] = "
                             f"[{batch}, {seq_len}], got {tuple(position_ids.shape)}")
        _cupy.check_contiguous(position_ids, "position_ids")
        if check_position_ids and position_ids.numel():
            lo, hi = int(position_ids.min()), int(position_ids.max())
            if lo < 0 or hi >= rows:
                raise ValueError(f"position_ids span [{lo}, {hi}] but sin/cos have {rows} rows "
                                 "(upstream would read out of bounds)")
    _cupy.check_contiguous(sin, "sin")
    _cupy.check_contiguous(cos, "cos")


# ---- launch ---------------------------------------------------------------------------------
def _launch(xs: list[torch.Tensor], sin, cos, position_ids, *, sign: int,
            use_neox_rotary_style: bool, time_major: bool, rotary_emb_base: float,
            device: int) -> list[torch.Tensor]:
    """FusedRopeKernel / FusedRopeGradKernel: one launch for equal head counts, two for GQA."""
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
    sm_count, max_threads = _device_limits(device)
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


class _FusedRope(torch.autograd.Function):
    """Forward with sign +1; backward launches the same kernels on the gradients with sign -1."""

    @staticmethod
    def forward(ctx, config, sin, cos, position_ids, *xs):
        ctx.config = config
        ctx.save_for_backward(*(t for t in (sin, cos, position_ids) if t is not None))
        ctx.present = (sin is not None, position_ids is not None)
        return tuple(_launch(list(xs), sin, cos, position_ids, sign=1, **config))

    @staticmethod
    def backward(ctx, *grads):
        saved = list(ctx.saved_tensors)
        has_tables, has_ids = ctx.present
        sin, cos = (saved.pop(0), saved.pop(0)) if has_tables else (None, None)
        position_ids = saved.pop(0) if has_ids else None
        grads = [g.contiguous() for g in grads]
        dxs = _launch(grads, sin, cos, position_ids, sign=-1, **ctx.config)
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
    >>> out_q, _, _ = fused_rotary_position_embedding(q)  # interleaved, base 10000  # doctest: +SKIP
    """
    device = _check_inputs(q, k, v, sin, cos, position_ids, use_neox_rotary_style, time_major,
                           rotary_emb_base, check_position_ids)
    xs = [t for t in (q, k, v) if t is not None]
    config = dict(use_neox_rotary_style=bool(use_neox_rotary_style), time_major=bool(time_major),
                  rotary_emb_base=float(rotary_emb_base), device=device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in xs):
        outs = list(_FusedRope.apply(config, sin, cos, position_ids, *xs))
    else:
        outs = _launch(xs, sin, cos, position_ids, sign=1, **config)
    it = iter(outs)
    return tuple(next(it) if t is not None else None for t in (q, k, v))


__all__ = ["fused_rotary_position_embedding", "launch_config_1d", "LaunchConfig", "MODULE"]
