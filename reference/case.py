"""The canonical case: one description of a RoPE problem that every implementation is called with.

A :class:`RopeCase` is small, frozen and hashable; :func:`make_inputs` turns it into fresh random
tensors from a seed. Each registered implementation translates the case to its own API at its
boundary (see ``ports/*/canonical.py``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from reference.layouts import shape_of
from reference.tables import angles, expand_half, inv_freq
from reference.vocabulary import (
    COS_SIN_DTYPES, DIRECTIONS, DTYPES, GRAD_KINDS, HEAD_AXIS, LAYOUTS, POSITION_KINDS, STYLES,
    check_choice,
)


@dataclass(frozen=True)
class RopeCase:
    """One RoPE problem.

    Parameters
    ----------
    batch, seqlen, heads, head_dim
        ``b`` sequences of ``s`` tokens with ``h`` heads of ``d`` channels. For ``thd`` the
        sequences have lengths ``seqlens`` (each ``<= seqlen``), packed along T.
    layout
        ``sbhd``, ``bshd``, ``bhsd`` or ``thd``.
    dtype
        Storage dtype of x and of the output: ``fp32``, ``fp16``, ``bf16`` or ``fp64``.
    style
        ``rotate_half`` (pairs (i, i+R/2)) or ``interleaved`` (pairs (2i, 2i+1)).
    rotary_dim
        R, the rotated channels (``None`` = head_dim); channels R..D-1 pass through bit-exact.
    positions
        ``arange``: token i of every sequence sits at i. ``offset``: each sequence starts at its
        own random offset. ``ids``: random, non-monotonic per-token ids, a different row per
        sequence.
    base
        RoPE base (theta) for the tables and for kernels that compute angles themselves.
    cos_sin_dtype
        dtype of the given cos/sin tables: ``fp32``, ``fp64`` or ``same`` (x's dtype).
    direction
        ``forward`` (y from x) or ``backward`` (dx from dy).
    contiguous
        ``False`` cuts x (and k) out of a packed qkv tensor: strided, last dim contiguous.
    seqlens
        thd only: the length of each packed sequence.
    max_position
        Length of the cos/sin table (``None``: just enough for the positions drawn).
    asymmetric
        The two members of each pair get different cos/sin (exposes backward bugs that use the
        element's own sine instead of its partner's). Real RoPE tables are symmetric.
    kv_heads
        If set, the case also has a k tensor with this many heads (GQA/MQA).
    with_v
        Also rotate a v tensor (kv_heads heads), as Paddle's q/k/v-in-one-launch API can.
    grad
        Backward only: ``random`` dy, or ``broadcast`` (the zero-stride dy of ``out.sum() * 2``).
    """

    batch: int
    seqlen: int
    heads: int
    head_dim: int
    layout: str = "bshd"
    dtype: str = "fp32"
    style: str = "rotate_half"
    rotary_dim: int | None = None
    positions: str = "arange"
    base: float = 10000.0
    cos_sin_dtype: str = "fp32"
    direction: str = "forward"
    contiguous: bool = True
    seqlens: tuple[int, ...] | None = None
    max_position: int | None = None
    asymmetric: bool = False
    kv_heads: int | None = None
    with_v: bool = False
    grad: str = "random"
    label: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("batch", "seqlen", "heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_choice("layout", self.layout, LAYOUTS)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("style", self.style, STYLES)
        check_choice("positions", self.positions, POSITION_KINDS)
        check_choice("cos_sin_dtype", self.cos_sin_dtype, COS_SIN_DTYPES)
        check_choice("direction", self.direction, DIRECTIONS)
        check_choice("grad", self.grad, GRAD_KINDS)
        if self.rot_dim % 2 or not 0 < self.rot_dim <= self.head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], "
                             f"got {self.rot_dim}")
        if self.layout == "thd":
            if self.seqlens is None or len(self.seqlens) != self.batch:
                raise ValueError("a thd case needs seqlens, one length per sequence")
            if any(n < 1 or n > self.seqlen for n in self.seqlens):
                raise ValueError(f"every seqlen must be in [1, {self.seqlen}], got {self.seqlens}")
            if self.positions == "offset":
                raise ValueError("thd cases take positions 'arange' (restart per sequence) or 'ids'")
        elif self.seqlens is not None:
            raise ValueError("seqlens only applies to the thd layout")
        if self.kv_heads is not None and self.kv_heads < 1:
            raise ValueError(f"kv_heads must be positive, got {self.kv_heads}")
        if self.with_v and self.kv_heads is None:
            raise ValueError("with_v needs kv_heads (v has the kv head count)")
        if self.max_position is not None and self.max_position < self.min_table_rows:
            raise ValueError(f"max_position {self.max_position} is below the {self.min_table_rows} "
                             "rows these positions need")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def rot_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def table_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.cos_sin_dtype == "same" else DTYPES[self.cos_sin_dtype]

    @property
    def tokens(self) -> int:
        """Tokens in one tensor: ``b * s``, or the packed total for thd."""
        return sum(self.seqlens) if self.layout == "thd" else self.batch * self.seqlen

    @property
    def head_counts(self) -> tuple[int, ...]:
        """Heads of each tensor the case rotates: (q,), (q, k) or (q, k, v)."""
        if self.kv_heads is None:
            return (self.heads,)
        return (self.heads, self.kv_heads, self.kv_heads) if self.with_v else (self.heads,
                                                                               self.kv_heads)

    def shape(self, heads: int | None = None) -> tuple[int, ...]:
        h = self.heads if heads is None else heads
        total = self.tokens if self.layout == "thd" else None
        return shape_of(self.layout, self.batch, self.seqlen, h, self.head_dim, total)

    @property
    def numel(self) -> int:
        """Elements of the largest tensor (what an index type must cover)."""
        return self.tokens * max(self.head_counts) * self.head_dim

    @property
    def min_table_rows(self) -> int:
        if self.positions == "arange":
            return self.seqlen
        return 2 * self.seqlen  # offsets and ids are drawn from [0, 2s)

    @property
    def table_rows(self) -> int:
        return self.max_position or self.min_table_rows

    def io_bytes(self) -> int:
        """Bytes a kernel must move: read every rotated tensor once and write it once.

        Forward reads x and writes y; backward reads dy and writes dx: the same count. cos/sin
        tables and positions are left out, as FlashInfer's benchmark leaves them out, because
        each design gets them differently (a table, fp32 angles, or computed in the kernel), so
        the count is the same for every design and GB/s compares like with like.
        """
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        per_tensor = [self.tokens * h * self.head_dim * elem for h in self.head_counts]
        return sum(2 * n for n in per_tensor)  # read + write

    def replace(self, **changes) -> RopeCase:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A compact, human-readable id, e.g. ``bshd 4x4096x32x128 bf16 rotate_half``."""
        dims = dict(b=self.batch, s=self.seqlen, h=self.heads, d=self.head_dim)
        order = "bshd" if self.layout == "thd" else self.layout
        text = f"{self.layout} {'x'.join(str(dims[c]) for c in order)} {self.dtype} {self.style}"
        extras = []
        if self.rot_dim != self.head_dim:
            extras.append(f"R={self.rot_dim}")
        if self.positions != "arange":
            extras.append(f"pos={self.positions}")
        if self.kv_heads is not None:
            extras.append(f"{'k,v' if self.with_v else 'k'}: {self.kv_heads} heads")
        if not self.contiguous:
            extras.append("strided")
        if self.asymmetric:
            extras.append("asym-tables")
        if self.cos_sin_dtype != "fp32":
            extras.append(f"cos/sin {self.cos_sin_dtype}")
        if self.base != 10000.0:
            extras.append(f"base={self.base:g}")
        if self.direction == "backward":
            extras.append("bwd" + ("(bcast dy)" if self.grad == "broadcast" else ""))
        return " ".join([text, *extras])


@dataclass
class RopeInputs:
    """Fresh tensors for one case (see :func:`make_inputs`). Implementations must not modify them.

    Attributes
    ----------
    xs
        The tensors to rotate: ``(q,)`` or ``(q, k)``, in ``case.layout``.
    grads
        Backward only: dy for each tensor of ``xs`` (``broadcast`` grads have zero strides).
    positions
        int64 per-token positions, ``[B, S]`` (``[T]`` for thd).
    offsets
        int64 ``[B]``: each sequence's first position (zeros unless ``case.positions == 'offset'``).
    cu_seqlens
        int32 ``[B + 1]`` for thd, else ``None``.
    cos, sin
        Full-width tables ``[L, R]`` in the style's natural layout, dtype ``case.table_dtype``.
    angles
        float64 ``[L, R/2]`` per-pair angles ``pos * inv_freq`` (the ideal, unrounded).
    inv_freq
        float64 ``[R/2]``.
    """

    xs: tuple[torch.Tensor, ...]
    grads: tuple[torch.Tensor, ...] | None
    positions: torch.Tensor
    offsets: torch.Tensor
    cu_seqlens: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    angles: torch.Tensor
    inv_freq: torch.Tensor

    @property
    def x(self) -> torch.Tensor:
        return self.xs[0]


def _random_tensor(case: RopeCase, heads: int, gen: torch.Generator, device) -> torch.Tensor:
    shape = case.shape(heads)
    if case.contiguous:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32
                           ).to(case.torch_dtype)
    # Cut x out of a packed qkv: the head axis is three times as wide, x is the first third.
    head_axis = HEAD_AXIS[case.layout]
    packed_shape = list(shape)
    packed_shape[head_axis] *= 3
    packed = torch.randn(packed_shape, generator=gen, device=device, dtype=torch.float32
                         ).to(case.torch_dtype)
    return packed.narrow(head_axis, 0, heads)


def asymmetric_angles(first: torch.Tensor) -> torch.Tensor:
    """Angles for the second member of each pair when tables are asymmetric (any fixed map works)."""
    return 1.3 * first + 0.2


def make_inputs(case: RopeCase, seed: int = 0, device: torch.device | str = "cpu") -> RopeInputs:
    """Fresh random inputs for ``case``, reproducible from ``seed``. Never zeros."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    b, s = case.batch, case.seqlen
    rows = case.table_rows

    cu_seqlens = None
    offsets = torch.zeros(b, dtype=torch.int64, device=device)
    if case.layout == "thd":
        lengths = torch.tensor(case.seqlens, dtype=torch.int64, device=device)
        cu = torch.zeros(b + 1, dtype=torch.int64, device=device)
        cu[1:] = torch.cumsum(lengths, 0)
        cu_seqlens = cu.to(torch.int32)
        if case.positions == "ids":
            positions = torch.randint(0, rows, (case.tokens,), generator=gen, device=device)
        else:  # restart at 0 in each sequence
            starts = torch.repeat_interleave(cu[:-1], lengths)
            positions = torch.arange(case.tokens, device=device) - starts
    elif case.positions == "arange":
        positions = torch.arange(s, device=device).expand(b, s).contiguous()
    elif case.positions == "offset":
        offsets = torch.randint(0, rows - s + 1, (b,), generator=gen, device=device)
        positions = offsets[:, None] + torch.arange(s, device=device)
    else:
        positions = torch.randint(0, rows, (b, s), generator=gen, device=device)

    freqs = inv_freq(case.rot_dim, case.base, device=device)
    ang = angles(torch.arange(rows, device=device), freqs)  # [L, R/2] float64
    first = expand_half(ang, case.style)
    if case.asymmetric:
        second = expand_half(asymmetric_angles(ang), case.style)
        member = torch.arange(case.rot_dim, device=device)
        is_second = (member >= case.rot_dim // 2) if case.style == "rotate_half" else (member % 2 == 1)
        full = torch.where(is_second, second, first)
    else:
        full = first
    cos, sin = torch.cos(full).to(case.table_dtype), torch.sin(full).to(case.table_dtype)

    xs = tuple(_random_tensor(case, h, gen, device) for h in case.head_counts)
    grads = None
    if case.direction == "backward":
        if case.grad == "broadcast":
            # d(out.sum() * 2)/d(out): a zero-stride tensor of twos (what autograd hands back).
            grads = tuple(torch.full((), 2.0, dtype=case.torch_dtype, device=device).expand(x.shape)
                          for x in xs)
        else:
            grads = tuple(torch.randn(x.shape, generator=gen, device=device,
                                      dtype=torch.float32).to(case.torch_dtype) for x in xs)
    return RopeInputs(xs=xs, grads=grads, positions=positions, offsets=offsets,
                      cu_seqlens=cu_seqlens, cos=cos, sin=sin, angles=ang, inv_freq=freqs)
