"""Validation: one call's arguments checked on the host and summed up as a :class:`Problem`.

A kernel fault would poison the CUDA context, so every argument is checked here, before any
launch. :func:`validate` makes the checks that depend on shapes, strides, dtypes and devices
(cached by input geometry: :func:`input_key`); :func:`check_contents` makes those that read
tensor contents (the ``check_positions`` checks) on every call.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from ports.fastrope.limits import MAX_GRID_Y
from reference import tables
from reference.vocabulary import (BSH_AXES, DIM_NAMES, INDEX_DTYPES, KERNEL_TORCH_DTYPES,
                                  LAYOUTS, STYLES)



class Positions(enum.IntEnum):
    """How each token's position is found: the one encoding of ``Problem.positions``, rope.cu's
    ``Params.positions`` and the step kernel's switches (rope.cu's ``enum Positions`` spells the
    same values; tests/test_fastrope.py checks that they agree)."""

    ARANGE = 0   # 0..S-1, plus the int ``offsets`` (0 without)
    OFFSETS = 1  # 0..S-1 plus the per-sequence ``offsets`` tensor
    IDS = 2      # the per-token ``positions`` tensor


@dataclass(frozen=True, kw_only=True, eq=False)  # compared and hashed by identity: one per key
class Problem:
    """A validated call, less its tensors' contents and addresses."""

    layout: str
    interleaved: bool
    batch: int                 # thd: 1
    seqlen: int                # thd: total tokens T
    head_dim: int
    rotary_dim: int
    computed: bool             # angles computed in the kernel (no cos/sin given)
    table_dtype: torch.dtype | None
    table_rows: int
    table_stride: int
    tables_need_copy: bool     # cos/sin strides differ: made contiguous per call
    half_table: bool           # cos/sin are [L, R/2], one angle per pair
    default_inv_freq: torch.Tensor | None  # computed angles without a given inv_freq
    positions: Positions       # how each token's position is found
    position_strides: tuple[int, int]  # the ids' (batch, sequence) strides; offsets: (b, 0)
    position_int32: bool       # the ids or offsets tensor is int32 (else int64)
    nseq: int                  # thd: sequences in cu_seqlens; else 0
    max_seqlen: int | None     # thd: the caller's bound on a sequence's length

    @property
    def check_syncs(self) -> bool:
        """Whether :func:`check_contents` may read device memory (cu_seqlens, ids or an offsets
        tensor), which a CUDA-graph capture does not allow."""
        return self.layout == "thd" or self.positions != Positions.ARANGE


def strides(x: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """x's (batch, sequence, head) element strides in ``layout`` (thd: batch stride 0)."""
    st = x.stride()
    if layout == "thd":
        return 0, st[0], st[1]
    b, s, h = BSH_AXES[layout]
    return st[b], st[s], st[h]


def heads(x: torch.Tensor, layout: str) -> int:
    return x.shape[1] if layout == "thd" else x.shape[BSH_AXES[layout][2]]


def geometry(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(batch, seqlen, heads, head_dim) of x in ``layout`` (thd: batch 1, seqlen T)."""
    if layout == "thd":
        return 1, x.shape[0], x.shape[1], x.shape[2]
    b, s, h = BSH_AXES[layout]
    return x.shape[b], x.shape[s], x.shape[h], x.shape[3]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_input(x, name: str, layout: str, api: str) -> None:
    """x is a tensor of a kernel dtype with ``layout``'s rank (``api`` names the caller)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in KERNEL_TORCH_DTYPES:
        raise TypeError(f"{name} has dtype {dtype_name(x.dtype)}; {api} supports float32, "
                        "float16 and bfloat16")
    rank = 3 if layout == "thd" else 4
    if x.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D [{DIM_NAMES[layout]}] for layout {layout!r}, "
                         f"got shape {tuple(x.shape)}")


def _check_tensor(x, name: str, layout: str) -> None:
    check_input(x, name, layout, "apply_rope")
    if not x.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {x.device}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride 1), got strides "
                         f"{x.stride()}; call .contiguous()")


def _check_index_tensor(t, name: str, shapes: list[tuple[int, ...]], device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {dtype_name(t.dtype)}")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got "
                         f"{tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


@functools.lru_cache(maxsize=64)
def default_inv_freq(device: torch.device, rotary_dim: int, base: float) -> torch.Tensor:
    """``base ** (-2j / R)`` in float64 (the oracle's own builder), cached per device."""
    return tables.inv_freq(rotary_dim, base, device=device)


def _check_k(q, k, layout: str, batch: int, seqlen: int, head_dim: int) -> None:
    _check_tensor(k, "k", layout)
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}")
    if k.device != q.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}")
    kb, ks, _, kd = geometry(k, layout)
    if (kb, ks, kd) != (batch, seqlen, head_dim):
        raise ValueError(f"k {tuple(k.shape)} and q {tuple(q.shape)} must match in every "
                         f"dimension but heads (layout {layout})")
    if k.data_ptr() == q.data_ptr() and k.numel():
        raise ValueError("q and k are the same memory; pass distinct tensors")


def _check_packed(q, cu_seqlens, max_seqlen) -> int:
    """thd's cu_seqlens and max_seqlen; the number of sequences."""
    if cu_seqlens is None:
        raise ValueError("layout 'thd' needs cu_seqlens (int32 [num_seqs + 1])")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 \
            or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.stride(0) != 1:
        raise ValueError("cu_seqlens must be a contiguous 1-D int32 tensor [num_seqs + 1]")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    if max_seqlen is not None and (not isinstance(max_seqlen, int) or max_seqlen < 0):
        raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
    return cu_seqlens.numel() - 1


def _check_tables(q, cos, sin, rot: int) -> None:
    half = rot // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in KERNEL_TORCH_DTYPES:
            raise TypeError(f"{name} has dtype {dtype_name(t.dtype)}; cos/sin must be float32 "
                            "(recommended), float16 or bfloat16")
        if t.dim() != 2 or t.shape[1] not in (rot, half):
            raise ValueError(f"{name} must be [max_position, rotary_dim={rot}] (or "
                             f"[max_position, {half}], one angle per pair), got "
                             f"{tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(f"cos {tuple(cos.shape)} {cos.dtype} and sin {tuple(sin.shape)} "
                         f"{sin.dtype} must match")
    if cos.shape[0] == 0:
        raise ValueError("cos/sin have no rows")


def validate(*, q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style, layout,
             rotary_dim, base, inv_freq) -> Problem:
    """Every check that depends on shapes, strides, dtypes and devices (not on contents); the
    arguments are ``apply_rope``'s."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")
    _check_tensor(q, "q", layout)
    batch, seqlen, _, head_dim = geometry(q, layout)
    if k is not None:
        _check_k(q, k, layout, batch, seqlen, head_dim)
    rot = head_dim if rotary_dim is None else rotary_dim
    if not isinstance(rot, int) or rot <= 0 or rot % 2 or rot > head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got "
                         f"{rotary_dim}")
    half = rot // 2
    if batch > MAX_GRID_Y:
        raise ValueError(f"batch {batch} exceeds the grid's y limit ({MAX_GRID_Y}); pack "
                         "the sequences as thd instead")

    nseq = 0
    if layout == "thd":
        nseq = _check_packed(q, cu_seqlens, max_seqlen)
    elif cu_seqlens is not None or max_seqlen is not None:
        raise ValueError(f"cu_seqlens and max_seqlen only apply to layout 'thd', not {layout!r}")

    # Positions: 0..S-1 (plus a scalar or per-sequence offset), or per-token ids.
    form, pos_tensor, pos_strides = Positions.ARANGE, None, (0, 0)
    if positions is not None and offsets is not None:
        raise ValueError("pass positions (per-token ids) or offsets (per sequence), not both")
    if positions is not None:
        shapes = [(seqlen,)] if layout == "thd" else [(batch, seqlen), (seqlen,)]
        _check_index_tensor(positions, "positions", shapes, q.device)
        form, pos_tensor = Positions.IDS, positions
        pos_strides = ((0, positions.stride(0)) if positions.dim() == 1
                       else (positions.stride(0), positions.stride(1)))
    elif isinstance(offsets, torch.Tensor):
        n = nseq if layout == "thd" else batch
        _check_index_tensor(offsets, "offsets", [(n,)], q.device)
        form, pos_tensor, pos_strides = Positions.OFFSETS, offsets, (offsets.stride(0), 0)
    elif offsets is not None and not isinstance(offsets, int):
        raise TypeError(f"offsets must be an int or an int tensor, got {type(offsets).__name__}")

    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither (angles computed from base)")
    table_dtype, rows, stride, copy, half_table, inv = None, 0, 0, False, False, None
    if cos is not None:
        _check_tables(q, cos, sin, rot)
        copy = cos.stride(1) != 1 or sin.stride(1) != 1 or cos.stride(0) != sin.stride(0)
        table_dtype, rows = cos.dtype, cos.shape[0]
        stride = cos.shape[1] if copy else cos.stride(0)
        half_table = cos.shape[1] == half
    elif inv_freq is None:
        if not base > 0:
            raise ValueError(f"base must be positive, got {base}")
        inv = default_inv_freq(q.device, rot, float(base))
    elif not isinstance(inv_freq, torch.Tensor) or tuple(inv_freq.shape) != (half,):
        raise ValueError(f"inv_freq must be a tensor [rotary_dim / 2 = {half}]")
    return Problem(
        layout=layout, interleaved=style == "interleaved", batch=batch, seqlen=seqlen,
        head_dim=head_dim, rotary_dim=rot, computed=cos is None, table_dtype=table_dtype,
        table_rows=rows, table_stride=stride, tables_need_copy=copy, half_table=half_table,
        default_inv_freq=inv, positions=form, position_strides=pos_strides,
        position_int32=pos_tensor is not None and pos_tensor.dtype == torch.int32, nseq=nseq,
        max_seqlen=max_seqlen)


def _min_max(t: torch.Tensor) -> tuple[int, int]:
    lo, hi = torch.stack([t.min(), t.max()]).tolist()  # one device sync
    return int(lo), int(hi)


def check_contents(p: Problem, *, cos, positions, offsets, cu_seqlens) -> None:
    """The checks that read tensor contents (``check_positions``): cu_seqlens well formed and
    every position inside the table. thd, ids and offset tensors cost one device sync each."""
    span = p.seqlen
    if p.layout == "thd":
        span = p.max_seqlen
        cu = cu_seqlens.tolist()  # one sync: the kernel trusts these bounds
        if cu[0] != 0 or cu[-1] != p.seqlen or any(a > b for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to t = {p.seqlen}, got "
                             f"{cu[:8]}{'...' if len(cu) > 8 else ''}")
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        if span is not None and span < longest:
            raise ValueError(f"max_seqlen {span} is below the longest sequence ({longest})")
        span = longest
    if cos is None:
        return
    pos_add = offsets if isinstance(offsets, int) else 0
    if p.positions == Positions.IDS:
        lo, hi = _min_max(positions) if positions.numel() else (0, 0)
    else:
        lo, hi = 0, max(span, 1) - 1
        if p.positions == Positions.OFFSETS and offsets.numel():
            olo, ohi = _min_max(offsets)
            lo, hi = lo + olo, hi + ohi
    lo, hi = lo + pos_add, hi + pos_add
    if lo < 0 or hi >= p.table_rows:
        raise IndexError(f"positions reach [{lo}, {hi}] but cos/sin have {p.table_rows} rows: "
                         "every position must index a row")


def _meta(t):
    if type(t) is not torch.Tensor:
        raise TypeError
    return t.dtype, t.shape, t.stride(), t.get_device()


def input_key(q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style, layout,
              rotary_dim, base, inv_freq, extra, out=None) -> tuple | None:
    """Everything :func:`validate` and the launch plan depend on, with ``extra`` (what else the
    caller's cached launches depend on) and the given outputs ``out`` (a list, or None): a dict
    key for both. None: not cacheable (an argument of an unexpected type, or a tensor subclass),
    validate every call.

    Every call computes it, so it is written for the common calls (q, and cos/sin when given):
    one tuple, each tensor's metadata read once. Its tensor reads are most of a cached call's
    host time."""
    if type(q) is not torch.Tensor:
        return None
    try:
        q_ptr = q.data_ptr()
        align = q_ptr
        key = (q.dtype, q.shape, q.stride(), q.get_device(), style, layout, rotary_dim, extra,
               max_seqlen)
        if k is not None:
            k_ptr = k.data_ptr()
            align |= k_ptr
            key += (_meta(k), k_ptr == q_ptr)
        if cos is not None:
            if type(cos) is not torch.Tensor or type(sin) is not torch.Tensor:
                return None
            align |= cos.data_ptr() | sin.data_ptr()
            key += (cos.dtype, cos.shape, cos.stride(), cos.get_device(), sin.dtype, sin.shape,
                    sin.stride(), sin.get_device())
        elif inv_freq is None:
            key += (base,)
        else:
            key += (_meta(inv_freq),)
        if positions is not None or offsets is not None or cu_seqlens is not None:
            key += (None if positions is None else _meta(positions),
                    None if offsets is None else
                    "int" if isinstance(offsets, int) else _meta(offsets),
                    None if cu_seqlens is None else _meta(cu_seqlens))
        if out is not None:
            for o in out:
                align |= o.data_ptr()
                key += (_meta(o),)
        return key + (align & 15,)
    except (TypeError, AttributeError):
        return None
