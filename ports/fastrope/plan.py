"""The launch plan: vector width, heads per step, grid and block, chosen on the host per problem.

Everything here is plain integer arithmetic on shapes, strides and addresses:

* ``V`` (elements per chunk): the widest power of two up to 16 bytes that divides R/2
  (rotate-half) or R (interleaved), the pass-through tail, every stride of every tensor, and
  keeps every address (tensors and cos/sin rows) aligned to the access it makes.
* ``unroll`` (heads per thread per step) and head splits from the work size: a decode step
  needs many small blocks to cover the SMs, a prefill shape needs few threads with many
  independent loads each. 16-bit rotate-half from tables past the L2 takes 8-byte accesses
  and 2 heads per step instead of 16 and 4 (half the registers, twice the resident warps), or
  4 where 2 would leave more head slots idle; fp32 in place from tables past the L2, 2 where
  every thread still takes one step.
* ``IDX``: 32-bit offsets when every offset fits, else 64-bit.
* streaming (evict-first) loads and stores only when the data the call reads and writes is more
  than the L2 holds: a call that fits leaves its data there for the next reader.
* grid (token blocks, sequences, head splits) x block (chunks, head lanes, tokens); sbhd walks
  the (s, b) tokens in memory order instead (``fold``).
* small and mid-sized problems (a decode step, a prefill up to ``step_work_bound`` times the
  resident threads) from given tables take rope.cu's step kernel instead: one thread per
  (token, chunk) and one head (in place on L2-sized 16-bit prefills, 2 or 4:
  ``step_heads_per_thread``), grid (S, B, head blocks), 32-bit fields, the problem's switches
  (position form, id width, table width, direction) compiled in.

The keyword arguments of :func:`choose` after ``in_place`` force an ablation (see ablation.py);
their defaults are the design.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ports.fastrope import kernel
from reference.vocabulary import INT32_MAX

MAX_GRID_Y = 65535
THREADS_PER_BLOCK = 256         # rope.cu is built with __launch_bounds__(256)
MAX_TOKENS_PER_BLOCK = 64       # blockDim.z limit
SMEM_LIMIT = 16 * 1024          # computed angles: shared cos/sin rows per block


@dataclass(frozen=True)
class Operand:
    """One tensor the launch rotates: its input view and where the result goes."""

    src: torch.Tensor
    dst: torch.Tensor
    heads: int
    src_strides: tuple[int, int, int]  # batch, sequence, head (elements)
    dst_strides: tuple[int, int, int]


@dataclass(frozen=True)
class Plan:
    """One launch's kernel and shape."""

    kernel: str             # the instantiation (kernel.kernel_name)
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    vector: int             # V, elements per access
    unroll: int             # heads per thread per step
    index_bits: int         # 32 or 64
    rot_chunks: int         # chunk threads per row over the rotated channels
    tail_chunks: int        # chunk threads per row over the pass-through tail
    heads_per_split: int    # heads one block covers (grid.z splits the rest)
    fold: int               # B when the grid walks the (s, b) tokens b-fastest (sbhd), else 0
    step: bool = False      # rope_step: one thread per (token, head, chunk), grid (S, B, heads)


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def _max_offset(shape_strides) -> int:
    return sum((n - 1) * s for n, s in shape_strides)


def vector_width(elem_size: int, units: tuple[int, ...], strides: tuple[int, ...],
                 addresses: tuple[int, ...], table_elem_size: int, table_per_chunk,
                 table_stride: int, table_address: int, minimum: int) -> int:
    """Widest V (a power of two, V * elem_size <= 16) that divides every unit and stride and
    keeps every access aligned; ``table_per_chunk(V)`` is the cos/sin elements one chunk reads.
    0 when not even ``minimum`` fits."""
    v = 16 // elem_size
    while v >= minimum:
        t = table_per_chunk(v)
        t_align = min(16, t * table_elem_size)
        if (all(u % v == 0 for u in units) and all(s % v == 0 for s in strides)
                and all(a % (v * elem_size) == 0 for a in addresses)
                and (table_elem_size == 0
                     or (table_stride % t == 0 and table_address % t_align == 0))):
            return v
        v //= 2
    return 0


def heads_per_step(work: int, resident: int, capped: bool) -> int:
    """Heads per thread per step from the work (chunk-rows) against the resident threads: 4 from
    8x the resident threads; from 2x, 1 for the register-capped kernel (given tables, a thread
    per chunk: rope.cu's STUDY_MIN_BLOCKS) and 2 for the others; 1 below."""
    if work >= 8 * resident:
        return 4
    if work >= 2 * resident:
        return 1 if capped else 2
    return 1


def head_lanes(heads: int, unroll: int, chunks: int) -> int:
    """Head lanes of a block: as many as ``heads`` heads walked ``unroll`` per step need, up to
    what fits 256 threads of ``chunks`` chunk threads per lane."""
    return max(1, min(-(-heads // unroll), THREADS_PER_BLOCK // chunks))


def idle_head_slots(heads: int, unroll: int, chunks: int) -> int:
    """Head slots a block's passes leave idle when ``heads`` heads are walked ``unroll`` per step
    by its head lanes: every pass covers lanes x unroll heads."""
    lanes = head_lanes(heads, unroll, chunks)
    return -(-heads // (lanes * unroll)) * lanes * unroll - heads


def step_work_bound(elem_size: int, sbhd_batches: bool) -> int:
    """The step kernel takes problems of fewer chunk-rows than this many times the resident
    threads: 8 for 16-bit data, 4 for fp32. Up to there one thread per chunk-row (every load of a
    thread independent, no loop) is faster than the unrolled steps, L2-sized problems most
    (DESIGN.md has the measurements); beyond it the unrolled steps' fewer threads win. 2 for
    sbhd with B > 1 (``sbhd_batches``): the step grid walks one sequence at a time, where the
    main kernel walks the tokens in memory order."""
    if sbhd_batches:
        return 2
    return 8 if elem_size == 2 else 4


def step_heads_per_thread(in_place: bool, elem_size: int, work: int, resident: int, htot: int,
                          chunks: int, tokens: int, sms: int) -> int:
    """Heads per thread in the step kernel: 1, except in place on 16-bit data from 2x the
    resident threads' chunk-rows (an L2-sized prefill), where each thread loads and writes back
    several heads with the token's table chunk loaded once: 4, else 2, where the blocks of a
    token's heads then fill whole warps, at least two (an SM holds at most 32 blocks: blocks of
    one warp would leave half its threads idle). DESIGN.md has the measurements; fp32 and out of
    place gained nothing."""
    if not in_place or elem_size != 2 or work < 2 * resident:
        return 1
    for heads in (4, 2):
        threads = -(-htot // (step_head_blocks(htot, chunks, heads, tokens, sms) * heads)) * chunks
        if threads % 32 == 0 and threads >= 64:
            return heads
    return 1


def step_head_blocks(htot: int, chunks: int, heads: int, tokens: int, sms: int) -> int:
    """Blocks the step kernel spreads a token's ``htot`` heads over (``chunks`` threads per head,
    ``heads`` heads per thread): the fewest of <= 256 threads, or with fewer tokens than SMs
    (b = 1 decode) more and smaller ones, down to a warp each, so that more SMs share the
    token's instructions."""
    fewest = -(-htot // (THREADS_PER_BLOCK // chunks * heads))
    smallest = -(-htot // (max(1, 32 // chunks) * heads))
    return max(fewest, min(smallest, -(-sms // tokens)))


def choose(*, operands: list[Operand], batch: int, seqlen: int, head_dim: int, rotary_dim: int,
           interleaved: bool, tables, computed: bool, in_place: bool, flags: int = 0,
           shape_rule: str = "auto", vector_cap: int | None = None,
           index_bits: int | None = None, unroll: int | None = None,
           memory_order: bool = True, step_eligible: bool = False,
           step_kernel: bool = True, step_heads: int | None = None,
           one_half_per_thread: bool = False, hints_at_every_size: bool = False,
           step_switches: int = kernel.RUNTIME_SWITCHES, runtime_switches: bool = False) -> Plan:
    """The plan for this problem (see the module doc). ``tables`` is ``(cos, sin, half_table)``
    or ``None``. ``step_eligible``: the caller's part of the step kernel's conditions (no thd, the
    table and position fields fit 32 bits); ``step_switches``: the problem's
    ``kernel.step_switches`` for the step kernel to compile in (the default reads them at run
    time). Ablations: ``flags`` (kernel.RELOAD_TABLE, ...), ``shape_rule="fixed"`` (the prefill
    shape for every size), ``vector_cap``, ``index_bits``, ``unroll``, ``memory_order=False``,
    ``step_kernel=False``, ``step_heads``, ``one_half_per_thread``, ``hints_at_every_size`` and
    ``runtime_switches``."""
    q = operands[0].src
    elem = q.element_size()
    half = rotary_dim // 2
    # Computed angles: cos/sin rows [R] per token in shared memory (fp32 outputs add their low
    # parts). A rotate-half thread owns a chunk of both halves in place (a thread that loads its
    # partner from memory could read it after the partner's owner has overwritten it) and from
    # given tables (no partner loads: fewer bytes in flight per thread for the same work;
    # DESIGN.md). Computed angles out of place keep a thread per half (their rows are in shared
    # memory already), as does the one_half_per_thread ablation.
    lo = computed and q.dtype == torch.float32 and not flags & kernel.ANGLE_FP32
    angle_bytes = (4 if lo else 2) * rotary_dim * 4 if computed else 0
    if not interleaved and (in_place or (tables is not None and not one_half_per_thread)):
        flags |= kernel.BOTH_HALVES
    tail = head_dim - rotary_dim if not in_place else 0
    units = (half,) if not interleaved else (rotary_dim,)
    units += (tail,) if tail else ()
    strides, addresses = [], []
    for op in operands:
        for t, st in ((op.src, op.src_strides), (op.dst, op.dst_strides)):
            strides += [s for s, n in zip(st, (batch, seqlen, op.heads)) if n > 1]
            addresses.append(t.data_ptr())
    if tables is None:
        t_elem, t_stride, t_addr, per_chunk = 0, 1, 0, (lambda v: 1)
    else:
        cos, sin, half_table = tables
        t_elem, t_stride = cos.element_size(), cos.stride(0)
        t_addr = cos.data_ptr() | sin.data_ptr()  # aligned to x iff both are
        if not interleaved and not half_table:
            t_addr |= half * t_elem  # second-half rows start R/2 elements in
        per_chunk = (lambda v: v // 2) if interleaved and half_table else (lambda v: v)
    minimum = 2 if interleaved else 1
    v = vector_width(elem, units, tuple(strides), tuple(addresses), t_elem, per_chunk,
                     t_stride, t_addr, minimum)
    if vector_cap is not None and v:
        v = max(minimum, min(v, vector_cap))
    if v == 0:
        raise ValueError(
            "interleaved RoPE needs each pair in one aligned access: every stride must be even "
            f"and every tensor (and cos/sin row) {2 * elem}-byte aligned; got strides "
            f"{sorted(set(strides))}")
    split = interleaved or not flags & kernel.BOTH_HALVES  # a thread per chunk of the R channels
    if split and not interleaved and (rotary_dim + tail) // v > THREADS_PER_BLOCK:
        flags |= kernel.BOTH_HALVES  # rows wider than a block: a thread takes a chunk of each half
        split = False
    rot_chunks = (rotary_dim if split else half) // v
    tail_chunks = tail // v
    chunks = rot_chunks + tail_chunks
    htot = sum(op.heads for op in operands)
    tokens = batch * seqlen
    # Streaming hints only where the data outlives the L2 anyway. Data that fits stays there for
    # its next reader (the next layer's call in place, attention out of place); evict-first
    # accesses would send it to DRAM (DESIGN.md has what that costs). The cos/sin rows are left
    # out of the count.
    data_bytes = tokens * htot * head_dim * elem * (1 if in_place else 2)
    past_l2 = data_bytes > l2_bytes(q.get_device())
    if not hints_at_every_size and not past_l2:
        flags |= kernel.NO_CACHE_HINTS
    # sbhd (sequence stride outside the batch stride): walk the tokens in memory order, so the
    # blocks in flight read one dense span instead of B interleaved ones (DESIGN.md).
    sbhd_batches = batch > 1 and all(op.src_strides[1] > op.src_strides[0] for op in operands)
    fold = batch if (memory_order and sbhd_batches
                     and tokens <= INT32_MAX - MAX_TOKENS_PER_BLOCK) else 0  # t stays an int
    rows, grid_batch = (tokens, 1) if fold else (seqlen, batch)
    if index_bits is None:
        extent = 0
        for op in operands:
            for t, st in ((op.src, op.src_strides), (op.dst, op.dst_strides)):
                extent = max(extent, _max_offset(zip((batch, seqlen, op.heads), st)) + head_dim)
        index_bits = 32 if extent <= INT32_MAX else 64
    table_dtype = tables[0].dtype if tables is not None else torch.float32
    resident = sm_count(q.get_device()) * 2048
    work = tokens * htot * chunks  # chunk-rows: one thread's unit of work per head
    if (step_kernel and step_eligible and not computed and shape_rule == "auto" and unroll is None
            and not flags & kernel.DIVIDE and index_bits == 32
            and work < step_work_bound(elem, sbhd_batches) * resident
            and batch <= MAX_GRID_Y and chunks <= THREADS_PER_BLOCK):
        # The step kernel: every (token, head, chunk) its own thread; the heads of a token
        # spread evenly over as few blocks of <= 256 threads as hold them. Rotate-half threads
        # own a chunk of each half (no partner loads: half the threads and loads; DESIGN.md).
        step_flags = flags if interleaved else flags | kernel.BOTH_HALVES
        step_rot = rotary_dim // v if interleaved else half // v
        step_chunks = step_rot + tail_chunks
        sms = sm_count(q.get_device())
        heads = step_heads or step_heads_per_thread(in_place, elem, work, resident, htot,
                                                    step_chunks, tokens, sms)
        head_blocks = step_head_blocks(htot, step_chunks, heads, tokens, sms)
        lanes = -(-htot // (head_blocks * heads))
        if head_blocks <= MAX_GRID_Y:
            switches = kernel.RUNTIME_SWITCHES if runtime_switches else step_switches
            name = kernel.step_kernel_name(q.dtype, table_dtype, v, interleaved, step_flags, heads,
                                           switches)
            return Plan(name, (seqlen, batch, head_blocks), (step_chunks, lanes, 1), 0, v, heads,
                        32, step_rot, tail_chunks, lanes, 0, step=True)
    past_l2_rule = (past_l2 and flags & kernel.BOTH_HALVES and not computed and unroll is None
                    and vector_cap is None and shape_rule == "auto")
    if past_l2_rule and elem == 2 and v == 8:
        # 16-bit from tables past the L2: 8-byte accesses and 2 heads per step, half the
        # registers of 16 bytes x 4 heads x both halves, so twice the resident blocks; 4 heads
        # per step where that leaves fewer head slots of the block idle (40 heads: one pass of
        # 10 lanes instead of 16 lanes and a second pass of 8 heads on 4 of them). DESIGN.md
        # ("Registers") has the measurements.
        v = 4
        rot_chunks, tail_chunks = half // v, tail // v
        chunks = rot_chunks + tail_chunks
        unroll = min((2, 4), key=lambda u: idle_head_slots(htot, u, chunks))
    elif (past_l2_rule and elem == 4 and in_place and not interleaved
          and 2 * head_lanes(htot, 2, chunks) >= htot):
        # fp32 in place from tables past the L2: 2 heads per step (70 registers, 3 blocks per SM,
        # against 88 and 2 for 4 heads) where every thread still takes one step (up to 32 heads
        # of 128): in place, a step's loads wait for the last step's stores to the same rows
        # (DESIGN.md, "Registers").
        unroll = 2
    if unroll is None:
        if shape_rule == "fixed":     # ablation: the prefill shape for every size
            unroll = 4
        else:
            unroll = heads_per_step(work, resident, capped=not computed and split)
    if chunks > THREADS_PER_BLOCK:
        raise ValueError(f"head_dim {head_dim} needs {chunks} threads per row, more than a block "
                         f"of {THREADS_PER_BLOCK}")
    lanes = head_lanes(htot, unroll, chunks)
    tokens_per_block = max(1, min(MAX_TOKENS_PER_BLOCK, THREADS_PER_BLOCK // (chunks * lanes),
                                  rows))
    if angle_bytes:
        tokens_per_block = max(1, min(tokens_per_block, SMEM_LIMIT // angle_bytes))
    splits = 1
    if shape_rule != "fixed":  # split the heads until the blocks cover the SMs twice
        blocks = -(-rows // tokens_per_block) * grid_batch
        if blocks < 2 * sm_count(q.get_device()):
            splits = min(htot, -(-2 * sm_count(q.get_device()) // blocks))
    heads_per_split = -(-htot // splits)
    splits = -(-htot // heads_per_split)
    lanes = min(lanes, heads_per_split)

    name = kernel.kernel_name(q.dtype, table_dtype, v, interleaved, computed, index_bits, unroll,
                              flags)
    grid = (-(-rows // tokens_per_block), grid_batch, splits)
    block = (chunks, lanes, tokens_per_block)
    smem = angle_bytes * tokens_per_block
    return Plan(name, grid, block, smem, v, unroll, index_bits, rot_chunks, tail_chunks,
                heads_per_split, fold)
