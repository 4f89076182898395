"""Context parallelism: one sequence split across ``world_size`` ranks, each rotating its shard.

Each rank holds some of every sequence's tokens and rotates them with
:func:`ports.fastrope.apply_rope`, passing the global positions of those tokens (and, for thd,
the local ``cu_seqlens``). RoPE rotates every token by its own position alone, so the shards,
gathered and put back in order, equal the rotation of the whole sequence: bit for bit, as each
token's elements meet the same table row (or computed angle) and the same arithmetic
(tests/test_gpu_context_parallel.py checks it on 2 GPUs with given tables, forward and backward).

Two splits, both along the token axis (bshd/bhsd: the sequence axis, sbhd: axis 0, thd: each
packed sequence on its own):

* ``contiguous``: each sequence cut into ``world_size`` equal chunks; rank r holds chunk r.
  Every length must be a multiple of ``world_size``.
* ``zigzag`` (load-balanced for causal attention): each sequence cut into ``2 * world_size``
  equal chunks; rank r holds chunks r and ``2 * world_size - 1 - r``, in that order. Every length
  must be a multiple of ``2 * world_size``. This is Megatron-LM's split
  (NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553:megatron/core/utils.py,
  ``_get_batch_on_this_cp_rank_per_sequence_balancing``) and, per packed sequence, Transformer
  Engine's (NVIDIA/TransformerEngine@d0067d0da6cb01811b8072a7d304f0e00344ce2b:
  transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py,
  ``get_batch_on_this_cp_rank``).

Departures from those two:

* Both splits, for every layout. Transformer Engine's RoPE takes ``cp_size``/``cp_rank`` and
  places each token assuming the zigzag split (its thd kernel in
  transformer_engine/common/fused_rope/fused_rope.cu, and rope.py's
  ``_get_freqs_on_this_cp_rank``), so a contiguous shard is rotated at the wrong positions
  without an error. Here the split hands the rotation explicit per-token positions, so the
  kernel assumes no split at all.
* A length the split cannot cut evenly raises a ValueError naming the sequence and the multiple
  it needs. Megatron's reshape fails with a bare shape error; TE's thd split floor-divides and
  drops the remainder (TE pads each sequence first, ``pad_thd_sequences_for_cp``: pad before
  splitting here too).

Example (on each rank; ``q``, ``k`` the whole batch)::

    split = ContextSplit(world_size=W, scheme="zigzag", layout="thd", cu_seqlens=cu, device=dev)
    mine = split.rank_shard(rank)
    q_r, k_r = split.shard(q, rank), split.shard(k, rank)
    q_r, k_r = apply_rope(q_r, k_r, cos=cos, sin=sin, layout="thd", **mine.rope_arguments())
    # ... attention over the shards; a tensor whole again, on every rank, from each one's shard:
    q_whole = split.all_gather(q_r)  # or split.unshard(shards), shards[r] being rank r's

The positions are the tokens' places in their sequence (0 at each sequence's start). A caller
whose whole batch has its own position ids shards them with :meth:`ContextSplit.shard_positions`
and passes those instead; one with per-sequence offsets adds them (dense:
``offsets[:, None] + mine.positions``, ``[b, s_local]``), as apply_rope takes positions or
offsets, not both. Plain torch: nothing here launches a kernel, so the splits run (and are
tested) on any device; :meth:`ContextSplit.all_gather` is the one collective.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from reference.vocabulary import DIM_NAMES, LAYOUTS, TOKEN_AXIS, check_choice

Scheme = Literal["contiguous", "zigzag"]
SCHEMES: tuple[str, ...] = ("contiguous", "zigzag")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, eq=False)
class RankShard:
    """The tokens one rank holds, and what it rotates them with.

    Attributes
    ----------
    rank
        The rank, ``0 <= rank < world_size``.
    index
        int64 ``[n]``: for each local token, in local order, its index along the whole tensor's
        token axis (dense: the sequence position; thd: the packed token).
    positions
        int64 ``[n]``: each local token's position in its sequence (dense: equal to ``index``).
        ``apply_rope`` takes it for every layout (dense: one row for every batch entry).
    cu_seqlens
        thd: int32 ``[num_seqs + 1]``, the local sequences' boundaries; dense: None.
    max_seqlen
        thd: the longest local sequence; dense: None.
    """

    rank: int
    index: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor | None
    max_seqlen: int | None

    def rope_arguments(self) -> dict:
        """The keyword arguments ``apply_rope`` needs for this shard: positions, and for thd
        cu_seqlens and max_seqlen."""
        if self.cu_seqlens is None:
            return {"positions": self.positions}
        return {"positions": self.positions, "cu_seqlens": self.cu_seqlens,
                "max_seqlen": self.max_seqlen}


class ContextSplit:
    """How a batch's sequences are split across ``world_size`` ranks (see the module docstring).

    Parameters
    ----------
    world_size
        Ranks sharing each sequence, >= 1.
    scheme
        ``contiguous`` or ``zigzag``.
    layout
        The layout of the tensors to split: ``bshd``, ``sbhd``, ``bhsd`` or ``thd``.
    seqlen
        Dense layouts: the whole sequence length S (the size of the layout's sequence axis).
    cu_seqlens
        thd: the whole batch's boundaries, ``[num_seqs + 1]`` int32/int64 (tensor, on any device;
        read once) or a sequence of ints.
    device
        Where the index, positions and local cu_seqlens live (the device the shards are on).
    """

    def __init__(self, *, world_size: int, scheme: Scheme, layout: str, seqlen: int | None = None,
                 cu_seqlens: torch.Tensor | Sequence[int] | None = None,
                 device: torch.device | str | None = None) -> None:
        _check_int("world_size", world_size, 1)
        check_choice("scheme", scheme, SCHEMES)
        check_choice("layout", layout, LAYOUTS)
        self.world_size, self.scheme, self.layout = world_size, scheme, layout
        self.axis = TOKEN_AXIS[layout]
        self.device = torch.device("cpu" if device is None else device)
        if layout == "thd":
            if seqlen is not None:
                raise ValueError("layout 'thd' takes cu_seqlens, not seqlen")
            bounds = _read_bounds(cu_seqlens)
        else:
            if cu_seqlens is not None:
                raise ValueError(f"cu_seqlens only applies to layout 'thd', not {layout!r}; "
                                 "pass seqlen")
            if seqlen is None:
                raise ValueError(f"layout {layout!r} needs seqlen, the whole sequence length")
            _check_int("seqlen", seqlen, 0)
            bounds = [0, seqlen]
        self.chunks = world_size * (2 if scheme == "zigzag" else 1)  # chunks per sequence
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        for i, n in enumerate(lengths):
            if n % self.chunks:
                what = "the sequence length" if layout != "thd" else f"sequence {i}'s length"
                raise ValueError(
                    f"{what} {n} is not a multiple of {self.chunks} ({scheme} split over "
                    f"{world_size} ranks cuts each sequence into {self.chunks} equal chunks); "
                    "pad each sequence to a multiple first")
        self.tokens = bounds[-1]  # the whole tensor's token-axis size
        self._starts = torch.tensor(bounds[:-1], dtype=torch.int64)
        self._lengths = torch.tensor(lengths, dtype=torch.int64)
        self._shards: dict[int, RankShard] = {}
        self._inverse: torch.Tensor | None = None

    def rank_shard(self, rank: int) -> RankShard:
        """The tokens ``rank`` holds and its positions (computed once per rank)."""
        _check_int("rank", rank, 0)
        if rank >= self.world_size:
            raise ValueError(f"rank {rank} is out of range for world_size {self.world_size}; "
                             f"expected 0 <= rank < {self.world_size}")
        if rank not in self._shards:
            self._shards[rank] = self._make_shard(rank)
        return self._shards[rank]

    def _make_shard(self, rank: int) -> RankShard:
        w = self.world_size
        local = self._lengths // w  # each sequence's tokens on every rank
        local_cu = torch.zeros(local.numel() + 1, dtype=torch.int64)
        local_cu[1:] = torch.cumsum(local, 0)
        seq = torch.repeat_interleave(torch.arange(local.numel()), local)
        j = torch.arange(int(local_cu[-1])) - local_cu[:-1][seq]  # place within the local part
        chunk = self._lengths[seq] // self.chunks
        if self.scheme == "contiguous":
            position = rank * chunk + j
        else:  # chunk r, then chunk 2W - 1 - r
            second = j >= chunk
            position = torch.where(second, (2 * w - 1 - rank) * chunk + (j - chunk),
                                   rank * chunk + j)
        index = self._starts[seq] + position
        cu = max_seqlen = None
        if self.layout == "thd":
            cu = local_cu.to(torch.int32).to(self.device)
            max_seqlen = int(local.max()) if local.numel() else 0
        return RankShard(rank=rank, index=index.to(self.device),
                         positions=position.to(self.device), cu_seqlens=cu,
                         max_seqlen=max_seqlen)

    def _check_whole(self, x, name: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        rank = 3 if self.layout == "thd" else 4
        if x.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D [{DIM_NAMES[self.layout]}] for layout "
                             f"{self.layout!r}, got shape {tuple(x.shape)}")
        if x.shape[self.axis] != self.tokens:
            raise ValueError(f"{name} has {x.shape[self.axis]} tokens along axis {self.axis} "
                             f"but the split covers {self.tokens}")

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s shard of the whole tensor ``x`` (a new tensor; differentiable)."""
        self._check_whole(x, "x")
        index = self.rank_shard(rank).index
        return x.index_select(self.axis, index.to(x.device))

    def shard_positions(self, positions: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s part of the caller's own per-token ids: ``[s]`` or ``[b, s]`` (dense), or
        ``[t]`` (thd); the result goes to ``apply_rope(positions=...)``."""
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
        ranks = (1,) if self.layout == "thd" else (1, 2)
        if positions.dim() not in ranks or positions.shape[-1] != self.tokens:
            want = "[t]" if self.layout == "thd" else "[s] or [b, s]"
            raise ValueError(f"positions must be {want} with {self.tokens} tokens, got shape "
                             f"{tuple(positions.shape)}")
        index = self.rank_shard(rank).index
        return positions.index_select(-1, index.to(positions.device))

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's shard (``shards[r]``: rank r's), in the original
        token order; the inverse of :meth:`shard` (differentiable)."""
        if isinstance(shards, torch.Tensor) or len(shards) != self.world_size:
            got = "a tensor" if isinstance(shards, torch.Tensor) else f"{len(shards)}"
            raise ValueError(f"unshard takes a sequence of {self.world_size} shards, one per "
                             f"rank in rank order, got {got}")
        for r, s in enumerate(shards):
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"shard {r} must be a torch.Tensor, got {type(s).__name__}")
            n, dims = self.rank_shard(r).index.numel(), 3 if self.layout == "thd" else 4
            if s.dim() != dims or s.shape[self.axis] != n:
                raise ValueError(f"shard {r} must be {dims}-D [{DIM_NAMES[self.layout]}] with "
                                 f"{n} tokens along axis {self.axis}, got shape "
                                 f"{tuple(s.shape)}")
        if self._inverse is None:
            order = torch.cat([self.rank_shard(r).index.cpu() for r in range(self.world_size)])
            self._inverse = torch.argsort(order)
        cat = torch.cat(list(shards), self.axis)
        return cat.index_select(self.axis, self._inverse.to(cat.device))

    def all_gather(self, local: torch.Tensor, *, group=None,
                   buffers: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The whole tensor, on every rank, from each rank's ``local`` shard: torch.distributed's
        ``all_gather`` over ``group`` (initialised, ``world_size`` ranks, this split's rank
        order), then :meth:`unshard`. Not differentiable (a collective's backward is the
        caller's design: a reduce-scatter, or none).

        ``buffers``: ``world_size`` tensors shaped like ``local`` to receive the shards (reused
        across calls, or poisoned by a test); new ones by default.
        """
        import torch.distributed as dist  # only callers that gather need it initialised

        if not isinstance(local, torch.Tensor):
            raise TypeError(f"local must be a torch.Tensor, got {type(local).__name__}")
        ranks = dist.get_world_size(group)
        if ranks != self.world_size:
            raise ValueError(f"the process group has {ranks} ranks but the split has "
                             f"world_size {self.world_size}")
        if buffers is None:
            buffers = [torch.empty_like(local, memory_format=torch.contiguous_format)
                       for _ in range(ranks)]
        elif len(buffers) != ranks or any(
                b.shape != local.shape or b.dtype != local.dtype or b.device != local.device
                or not b.is_contiguous() for b in buffers):
            raise ValueError(f"buffers must be {ranks} contiguous tensors of local's shape "
                             f"{tuple(local.shape)}, dtype and device")
        dist.all_gather(list(buffers), local.contiguous(), group=group)
        return self.unshard(buffers)


def _read_bounds(cu_seqlens) -> list[int]:
    """thd's cu_seqlens as a list of ints, checked to rise from 0."""
    if cu_seqlens is None:
        raise ValueError("layout 'thd' needs cu_seqlens [num_seqs + 1]")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be a 1-D int32 or int64 tensor, got "
                             f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        bounds = cu_seqlens.tolist()
    else:
        bounds = list(cu_seqlens)
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
            raise TypeError("cu_seqlens must be an int tensor or a sequence of ints")
    if len(bounds) < 2 or bounds[0] != 0 or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 with at least two entries, got "
                         f"{bounds[:8]}{'...' if len(bounds) > 8 else ''}")
    return bounds
