"""``apply_rope`` / ``apply_rope_inplace``: checks on the host, then one launch (see rope.cu)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ports import _alloc, _cupy
from ports.fastrope import _launch
from reference import tables

STYLES = ("rotate_half", "interleaved")
LAYOUTS = ("bshd", "sbhd", "bhsd", "thd")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# Tensor dims holding (batch, sequence, head) per dense layout.
_AXES = {"bshd": (0, 1, 2), "sbhd": (1, 0, 2), "bhsd": (0, 2, 1)}
_DIMS = {"bshd": "b, s, h, d", "sbhd": "s, b, h, d", "bhsd": "b, h, s, d", "thd": "t, h, d"}

# What the CPU test compiles for sm_90: every dtype x convention x angle source at full width,
# 64-bit offsets, a narrow vector, and every ablation switch.
_KERNELS = tuple(
    _launch.kernel_name(dt, torch.float32, 16 // torch.empty((), dtype=dt).element_size(),
                        inter, comp, 32, 4)
    for dt in _launch.CTYPE for inter in (False, True) for comp in (False, True)
) + (_launch.kernel_name(torch.bfloat16, torch.bfloat16, 8, False, False, 64, 1),
     _launch.kernel_name(torch.float16, torch.float16, 2, True, False, 32, 2),
     _launch.kernel_name(torch.bfloat16, torch.float32, 8, False, False, 32, 4, 1 | 2 | 8),
     _launch.kernel_name(torch.float32, torch.float32, 4, False, True, 64, 1, 4),
     _launch.kernel_name(torch.bfloat16, torch.bfloat16, 8, False, False, 32, 4, 0),
     _launch.kernel_name(torch.float16, torch.float32, 8, False, True, 32, 2, 16))
MODULE = _cupy.CudaModule(__package__, _launch.FILENAME, kernels=_KERNELS,
                          options=_launch.OPTIONS)


@dataclass(frozen=True)
class Tuning:
    """Ablation switches (the design with one idea switched off); the default is the design."""

    flags: int = 0                  # rope.cu FLAGS: RELOAD_TABLE | NO_CACHE_HINTS | ANGLE_FP32 | DIVIDE
    shape_rule: str = "auto"        # "fixed": the prefill launch shape for every size
    vector_cap: int | None = None   # at most this many elements per access
    index_bits: int | None = None   # force 64-bit offsets
    unroll: int | None = None       # heads per thread per step
    separate_launches: bool = False  # q and k in two launches
    memory_order: bool = True       # False: sbhd grid walks each sequence in turn


DEFAULT_TUNING = Tuning()


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per input key
class _Problem:
    """A validated call, less its tensors' contents and addresses (cached per input geometry)."""

    layout: str
    interleaved: bool
    batch: int
    seqlen: int
    head_dim: int
    rotary_dim: int
    computed: bool
    table_dtype: torch.dtype | None
    table_rows: int
    table_stride: int
    tables_need_copy: bool   # cos/sin strides differ: made contiguous per call
    half_table: bool
    default_inv_freq: torch.Tensor | None  # computed angles without a given inv_freq
    pos_mode: int            # 0: 0..S-1 (+ int offset), 1: offsets tensor, 2: ids
    pos_strides: tuple[int, int]
    pos_int32: bool
    nseq: int
    max_seqlen: int | None
    tuning: Tuning


def _strides(x: torch.Tensor, layout: str) -> tuple[int, int, int]:
    st = x.stride()
    if layout == "thd":
        return 0, st[0], st[1]
    b, s, h = _AXES[layout]
    return st[b], st[s], st[h]


def _geometry(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(batch, seqlen, heads, head_dim) of x in ``layout`` (thd: batch 1, seqlen T)."""
    if layout == "thd":
        return 1, x.shape[0], x.shape[1], x.shape[2]
    b, s, h = _AXES[layout]
    return x.shape[b], x.shape[s], x.shape[h], x.shape[3]


def _check_tensor(x, name: str, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOATS:
        raise TypeError(f"{name} has dtype {str(x.dtype).replace('torch.', '')}; apply_rope "
                        "supports float32, float16 and bfloat16")
    rank = 3 if layout == "thd" else 4
    if x.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D [{_DIMS[layout]}] for layout {layout!r}, got "
                         f"shape {tuple(x.shape)}")
    if not x.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {x.device}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride 1), got strides "
                         f"{x.stride()}; call .contiguous()")


def _check_index_tensor(t, name: str, shapes: list[tuple[int, ...]], device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {str(t.dtype).replace('torch.', '')}")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got "
                         f"{tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


@functools.lru_cache(maxsize=64)
def _default_inv_freq(device: torch.device, rotary_dim: int, base: float) -> torch.Tensor:
    """``base ** (-2j / R)`` in float64 (the oracle's own builder), cached per device."""
    return tables.inv_freq(rotary_dim, base, device=device)


def _min_max(t: torch.Tensor) -> tuple[int, int]:
    lo, hi = torch.stack([t.min(), t.max()]).tolist()  # one device sync
    return int(lo), int(hi)


def _problem(q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style, layout,
             rotary_dim, base, inv_freq, tuning) -> _Problem:
    """Every check that depends on shapes, strides, dtypes and devices (not on contents)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")
    _check_tensor(q, "q", layout)
    batch, seqlen, _, head_dim = _geometry(q, layout)
    if k is not None:
        _check_tensor(k, "k", layout)
        if k.dtype != q.dtype:
            raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}")
        if k.device != q.device:
            raise ValueError(f"k is on {k.device} but q is on {q.device}")
        kb, ks, _, kd = _geometry(k, layout)
        if (kb, ks, kd) != (batch, seqlen, head_dim):
            raise ValueError(f"k {tuple(k.shape)} and q {tuple(q.shape)} must match in every "
                             f"dimension but heads (layout {layout})")
        if k.data_ptr() == q.data_ptr() and k.numel():
            raise ValueError("q and k are the same memory; pass distinct tensors")
    rot = head_dim if rotary_dim is None else rotary_dim
    if not isinstance(rot, int) or rot <= 0 or rot % 2 or rot > head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    half = rot // 2
    if batch > _launch.MAX_GRID_Y:
        raise ValueError(f"batch {batch} exceeds the grid's y limit ({_launch.MAX_GRID_Y}); pack "
                         "the sequences as thd instead")

    nseq = 0
    if layout == "thd":
        if cu_seqlens is None:
            raise ValueError("layout 'thd' needs cu_seqlens (int32 [num_seqs + 1])")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 \
                or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.stride(0) != 1:
            raise ValueError("cu_seqlens must be a contiguous 1-D int32 tensor [num_seqs + 1]")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
        nseq = cu_seqlens.numel() - 1
        if max_seqlen is not None and (not isinstance(max_seqlen, int) or max_seqlen < 0):
            raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
    elif cu_seqlens is not None or max_seqlen is not None:
        raise ValueError(f"cu_seqlens and max_seqlen only apply to layout 'thd', not {layout!r}")

    # Positions: 0..S-1 (plus a scalar or per-sequence offset), or per-token ids.
    pos_mode, pos_tensor, pos_strides = 0, None, (0, 0)
    if positions is not None and offsets is not None:
        raise ValueError("pass positions (per-token ids) or offsets (per sequence), not both")
    if positions is not None:
        shapes = [(seqlen,)] if layout == "thd" else [(batch, seqlen), (seqlen,)]
        _check_index_tensor(positions, "positions", shapes, q.device)
        pos_mode, pos_tensor = 2, positions
        pos_strides = ((0, positions.stride(0)) if positions.dim() == 1
                       else (positions.stride(0), positions.stride(1)))
    elif isinstance(offsets, torch.Tensor):
        n = nseq if layout == "thd" else batch
        _check_index_tensor(offsets, "offsets", [(n,)], q.device)
        pos_mode, pos_tensor, pos_strides = 1, offsets, (offsets.stride(0), 0)
    elif offsets is not None and not isinstance(offsets, int):
        raise TypeError(f"offsets must be an int or an int tensor, got {type(offsets).__name__}")

    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither (angles computed from base)")
    table_dtype, rows, stride, copy, half_table, default_inv_freq = None, 0, 0, False, False, None
    if cos is not None:
        for name, t in (("cos", cos), ("sin", sin)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in FLOATS:
                raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; cos/sin "
                                "must be float32 (recommended), float16 or bfloat16")
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
        copy = cos.stride(1) != 1 or sin.stride(1) != 1 or cos.stride(0) != sin.stride(0)
        table_dtype, rows = cos.dtype, cos.shape[0]
        stride = cos.shape[1] if copy else cos.stride(0)
        half_table = cos.shape[1] == half
    elif inv_freq is None:
        if not base > 0:
            raise ValueError(f"base must be positive, got {base}")
        default_inv_freq = _default_inv_freq(q.device, rot, float(base))
    elif not isinstance(inv_freq, torch.Tensor) or tuple(inv_freq.shape) != (half,):
        raise ValueError(f"inv_freq must be a tensor [rotary_dim / 2 = {half}]")
    return _Problem(layout, style == "interleaved", batch, seqlen, head_dim, rot, cos is None,
                    table_dtype, rows, stride, copy, half_table, default_inv_freq, pos_mode,
                    pos_strides, pos_tensor is not None and pos_tensor.dtype == torch.int32,
                    nseq, max_seqlen, tuning)


def _check_contents(p: _Problem, cos, positions, offsets, cu_seqlens) -> None:
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
    if p.pos_mode == 2:
        lo, hi = _min_max(positions) if positions.numel() else (0, 0)
    else:
        lo, hi = 0, max(span, 1) - 1
        if p.pos_mode == 1 and offsets.numel():
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


def _input_key(q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style, layout,
               rotary_dim, base, inv_freq, tuning, in_place):
    """Everything :func:`_problem` and the plan depend on (None: not cacheable, validate)."""
    try:
        align = q.data_ptr()
        key = [_meta(q), style, layout, rotary_dim, tuning, in_place, max_seqlen]
        if k is not None:
            align |= k.data_ptr()
            key += (_meta(k), k.data_ptr() == q.data_ptr())
        if cos is not None:
            align |= cos.data_ptr() | sin.data_ptr()
            key += (_meta(cos), _meta(sin))
        elif inv_freq is None:
            key.append(base)
        else:
            key.append(_meta(inv_freq))
        if positions is not None:
            key.append(_meta(positions))
        if offsets is not None:
            key.append("int" if isinstance(offsets, int) else _meta(offsets))
        if cu_seqlens is not None:
            key.append(_meta(cu_seqlens))
        key.append(align & 15)
        return tuple(key)
    except (TypeError, AttributeError):
        return None


# Validated problems and their forward launches, by input key; backward launches by geometry.
_ENTRIES: dict = {}
_BACKWARD: dict = {}
_CACHE_LIMIT = 1024


def _remember(cache: dict, key, value):
    if key is not None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = value
    return value


def _launches(p: _Problem, xs, outs, in_place: bool, backward: bool, cos, sin):
    """The launches for tensors ``xs`` (q, k) writing ``outs``: one, or one per tensor."""
    layout = p.layout
    operands = []
    for x, out in zip(xs, outs):
        heads = x.shape[1] if layout == "thd" else x.shape[_AXES[layout][2]]
        operands.append(_launch.Operand(x, out, heads, _strides(x, layout), _strides(out, layout))
                        if heads and x.numel() else None)
    t = p.tuning
    live = [i for i, op in enumerate(operands) if op is not None]
    groups = [[i] for i in live] if t.separate_launches else ([live] if live else [])
    result = []
    for group in groups:
        ops = [operands[i] for i in group]
        plan = _launch.plan(
            operands=ops, batch=p.batch, seqlen=p.seqlen, head_dim=p.head_dim,
            rotary_dim=p.rotary_dim, interleaved=p.interleaved,
            tables=None if p.computed else (cos, sin, p.half_table),
            computed=p.computed, in_place=in_place, flags=t.flags, shape_rule=t.shape_rule,
            vector_cap=t.vector_cap, index_bits=t.index_bits, unroll=t.unroll,
            memory_order=t.memory_order)
        lc = _launch.prepare(plan, ops, seqlen=p.seqlen, half=p.rotary_dim // 2,
                             half_table=p.half_table, table_rows=p.table_rows,
                             table_stride=p.table_stride, pos_mode=p.pos_mode,
                             pos_strides=p.pos_strides, pos_int32=p.pos_int32, nseq=p.nseq,
                             backward=backward)
        result.append((lc, tuple(group)))
    return result


class _Call:
    """The per-call tensors and scalars of a validated problem."""

    __slots__ = ("cos", "cu_seqlens", "inv_freq", "pos_add", "positions", "sin")

    def __init__(self, p: _Problem, q, cos, sin, positions, offsets, cu_seqlens, inv_freq):
        if p.tables_need_copy:
            cos, sin = cos.contiguous(), sin.contiguous()
        self.cos, self.sin = cos, sin
        self.inv_freq = None
        if p.computed:
            self.inv_freq = p.default_inv_freq if inv_freq is None else \
                inv_freq.to(device=q.device, dtype=torch.float64).contiguous()
        self.positions = positions if positions is not None else (
            offsets if isinstance(offsets, torch.Tensor) else None)
        self.cu_seqlens = cu_seqlens
        self.pos_add = offsets if isinstance(offsets, int) else 0


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _execute(launches, c: _Call, xs, outs) -> None:
    cos, sin, inv = _ptr(c.cos), _ptr(c.sin), _ptr(c.inv_freq)
    pos, cu = _ptr(c.positions), _ptr(c.cu_seqlens)
    for lc, group in launches:
        a = group[0]
        b = group[1] if len(group) > 1 else None
        _launch.launch(lc, xs[a].data_ptr(), 0 if b is None else xs[b].data_ptr(),
                       outs[a].data_ptr(), 0 if b is None else outs[b].data_ptr(),
                       cos, sin, inv, pos, cu, c.pos_add)


def _new_outputs(xs):
    outs = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]
    if _alloc._poison_depth:  # under ports._alloc.poisoned(): prove every element is written
        for out in outs:
            out.fill_(float("nan"))
    return outs


def _backward(ctx, grads):
    p, c = ctx.problem, ctx.call
    gs = [g if g.stride(-1) == 1 else g.contiguous() for g in grads]  # broadcast dy: dense
    outs = _new_outputs(gs)
    key = (p, tuple((g.dtype, g.shape, g.stride(), g.data_ptr() & 15) for g in gs),
           (_ptr(c.cos) | _ptr(c.sin)) & 15)
    launches = _BACKWARD.get(key)
    if launches is None:
        launches = _remember(_BACKWARD, key,
                             _launches(p, gs, outs, False, True, c.cos, c.sin))
    _execute(launches, c, gs, outs)
    return None, None, None, None, outs[0], (outs[1] if len(outs) > 1 else None)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, problem, call, launches, outs, q, k):
        ctx.problem, ctx.call = problem, call
        xs = [q] if k is None else [q, k]
        outs = outs or _new_outputs(xs)
        _execute(launches, call, xs, outs)
        return tuple(outs) if k is not None else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, grads)


class _RopeInplace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, problem, call, launches, outs, q, k):
        ctx.problem, ctx.call = problem, call
        xs = [q] if k is None else [q, k]
        _execute(launches, call, xs, xs)
        ctx.mark_dirty(*xs)
        return tuple(xs) if k is not None else q

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, grads)


def _apply(fn, in_place, q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style,
           layout, rotary_dim, base, inv_freq, check_positions, tuning):
    key = _input_key(q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style, layout,
                     rotary_dim, base, inv_freq, tuning, in_place)
    entry = _ENTRIES.get(key) if key is not None else None
    if entry is None:
        p = _problem(q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style, layout,
                     rotary_dim, base, inv_freq, tuning)
        entry = _remember(_ENTRIES, key, [p, None])
    p, launches = entry
    if check_positions:
        _check_contents(p, cos, positions, offsets, cu_seqlens)
    call = _Call(p, q, cos, sin, positions, offsets, cu_seqlens, inv_freq)
    xs = [q] if k is None else [q, k]
    outs = None
    if launches is None:  # first call of this geometry: plan with the real outputs
        outs = xs if in_place else _new_outputs(xs)
        launches = entry[1] = _launches(p, xs, outs, in_place, False, call.cos, call.sin)
    if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
        return fn.apply(p, call, launches, outs, q, k)
    if outs is None:
        outs = xs if in_place else _new_outputs(xs)
    _execute(launches, call, xs, outs)
    return outs[0] if k is None else tuple(outs)


def apply_rope(q, k=None, *, cos=None, sin=None, positions=None, offsets=None, cu_seqlens=None,
               max_seqlen=None, style="rotate_half", layout="bshd", rotary_dim=None,
               base=10000.0, inv_freq=None, check_positions=True, _tuning=DEFAULT_TUNING):
    """Rotate q (and k) by RoPE; new contiguous outputs, in one launch.

    Parameters
    ----------
    q, k
        ``[b, s, h, d]`` (bshd), ``[s, b, h, d]`` (sbhd), ``[b, h, s, d]`` (bhsd) or packed
        ``[t, h, d]`` (thd); float32/float16/bfloat16; any strides with the last dim contiguous.
        k may have a different head count (GQA/MQA).
    cos, sin
        Tables ``[L, rotary_dim]`` in the style's natural layout (rotate-half: concatenated
        halves; interleaved: each angle twice), or ``[L, rotary_dim / 2]`` (one angle per pair).
        Row = position. Omit both to compute the angles in the kernel, in fp64, from ``base``
        (or ``inv_freq [rotary_dim / 2]``, e.g. a scaled frequency set).
    positions
        Per-token ids: ``[b, s]`` or ``[s]`` (thd: ``[t]``), int32/int64.
    offsets
        Each sequence's first position (int tensor ``[b]``, thd: ``[num_seqs]``), or one int for
        all. Without positions or offsets, token i of each sequence sits at position i.
    cu_seqlens, max_seqlen
        thd only: int32 ``[num_seqs + 1]`` boundaries; ``max_seqlen`` spares a device sync when
        ``check_positions`` is off.
    style
        ``rotate_half`` (NeoX/HF, pairs ``(i, i + R/2)``) or ``interleaved`` (GPT-J, ``(2i, 2i+1)``).
    rotary_dim
        Rotated channels R (even, <= d); channels R..d-1 are copied unchanged.
    check_positions
        Check on the host that every position indexes a table row (and that cu_seqlens is
        well formed). Ids and offset tensors cost one device sync; pass False when they are known
        good (the kernel clamps rows, so a bad position is wrong, never out of bounds).
    """
    return _apply(_Rope, False, q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen, style,
                  layout, rotary_dim, base, inv_freq, check_positions, _tuning)


def apply_rope_inplace(q, k=None, *, cos=None, sin=None, positions=None, offsets=None,
                       cu_seqlens=None, max_seqlen=None, style="rotate_half", layout="bshd",
                       rotary_dim=None, base=10000.0, inv_freq=None, check_positions=True,
                       _tuning=DEFAULT_TUNING):
    """As :func:`apply_rope`, rotating q (and k) in place; returns them."""
    return _apply(_RopeInplace, True, q, k, cos, sin, positions, offsets, cu_seqlens, max_seqlen,
                  style, layout, rotary_dim, base, inv_freq, check_positions, _tuning)
