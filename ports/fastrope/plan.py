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
  ``step_heads_filling_warps``), grid (S, B, head blocks), 32-bit fields, the problem's switches
  (position form, id width, table width, direction) compiled in.
* inputs of at least twice the L2 take the step kernel in token tiles where a GPU's tuning table
  chooses them (the H200 out of place): grid (head blocks, S / 8, B), 8 tokens a block, so the
  blocks that run together cover consecutive tokens with all their heads; in sbhd with B > 1
  the tiles run across the batch, which is consecutive in memory.

Every decision is a row of :data:`RULES`: a name, the condition on the problem's facts under
which it holds, and the settings it gives; :func:`choose` looks each setting up in the table
(the first row that gives it and whose condition holds) and does the arithmetic that turns the
settings into grid and block. Each row names the DESIGN.md section with the measurement behind
it. ablation.py builds its plans from other tables (:func:`choose_from`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ports.fastrope import kernel, tuning
from ports.fastrope.limits import (MAX_GRID_Y, MAX_TOKENS_PER_BLOCK, SMEM_LIMIT,
                                   THREADS_PER_BLOCK)
from ports.fastrope.problem import Problem
from reference.vocabulary import INT32_MAX

__all__ = ["ALTERNATIVES", "MAX_GRID_Y", "MAX_TOKENS_PER_BLOCK", "RULES", "SMEM_LIMIT",
           "THREADS_PER_BLOCK", "Operand", "Plan", "Rule", "always", "choose", "choose_from",
           "device_rules", "unroll_from_work", "with_choices"]


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
    per chunk: rope.cu's ROWS_MIN_BLOCKS) and 2 for the others; 1 below."""
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


def step_heads_filling_warps(htot: int, chunks: int, tokens: int, sms: int,
                             whole_warps: bool = True) -> int:
    """Heads per step-kernel thread where several pay (in place, 16-bit, an L2-sized prefill:
    each thread loads and writes back several heads with the token's table chunk loaded once):
    4, else 2, where the blocks of a token's heads then hold at least two warps' threads (an SM
    holds at most 32 blocks: blocks of one warp would leave half its threads idle), in whole
    warps unless ``whole_warps`` is off; else 1."""
    for heads in (4, 2):
        threads = -(-htot // (step_head_blocks(htot, chunks, heads, tokens, sms) * heads)) * chunks
        if (threads % 32 == 0 or not whole_warps) and threads >= 64:
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


def token_tile(seqlen: int, chunks: int, most: int) -> int:
    """Tokens per block of the step kernel in token tiles (kernel.TOKEN_TILES): the most, up to
    ``most``, that divide ``seqlen`` (the kernel has no bound check on tokens), leave a block of
    ``chunks``-thread rows room for a head lane, and keep the tiles in grid.y; 1 where none
    does (the step kernel's usual grid, a token a block)."""
    tile = most
    while tile > 1 and (seqlen % tile or chunks * tile > THREADS_PER_BLOCK
                        or seqlen // tile > MAX_GRID_Y):
        tile //= 2
    return max(tile, 1)


def step_tile(seqlen: int, batch: int, chunks: int, most: int, across: bool) -> int:
    """The token tile the step kernel takes (:func:`token_tile`), 1 where none fits. ``across``
    (sbhd with B > 1): the tiles run across the batch, a block one position of ``tile``
    sequences, consecutive in memory, and the positions in grid.z, so S must fit it too."""
    if across:
        return token_tile(batch, chunks, most) if seqlen <= MAX_GRID_Y else 1
    return token_tile(seqlen, chunks, most)


# ---- the rules --------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)  # hashed by identity
class Rule:
    """One row of a plan table: where ``when(facts)`` holds, ``settings`` apply (a value, or a
    function of the facts that computes it). ``section``: the DESIGN.md section with the
    measurement behind it."""

    name: str
    section: str
    when: Callable[[SimpleNamespace], bool]
    settings: dict = field(default_factory=dict)


def always(f) -> bool:
    return True


def _fewest_idle_of_2_or_4(f) -> int:
    return min((2, 4), key=lambda u: idle_head_slots(f.htot, u, f.chunks))


def unroll_from_work(f) -> int:
    return heads_per_step(f.work, f.resident, capped=not f.computed and f.split)


def _step_heads(f, whole_warps: bool = True) -> int:
    return step_heads_filling_warps(f.htot, f.step_chunks, f.tokens, f.sms, whole_warps)


def _step_kernel_fits(f) -> bool:
    """The step kernel can take the problem: given tables, its fields in 32 bits, the batch in
    grid.y, a row's chunks in one block."""
    return (f.step_eligible and not f.computed and f.index_bits == 32
            and f.batch <= MAX_GRID_Y and f.chunks <= THREADS_PER_BLOCK)


def _below_work_bound(f) -> bool:
    return f.work < step_work_bound(f.elem, f.sbhd_batches) * f.resident


def _tiles_may_take(f) -> bool:
    """Rotate-half data from tables, an input (the bytes read) of at least twice the L2, with
    32-bit offsets and the step kernel's fields. On the H200 the tiles lost 1-7% to the rows
    kernel on 16-bit inputs of 67 MB (just past its 60 MiB L2) and won up to 7% from 134 MB, in
    fp32 and in sbhd with batches too (DESIGN.md, "Token tiles")."""
    return (not f.interleaved and f.tables and f.input_bytes >= 2 * f.l2 and f.step_eligible
            and f.extent <= INT32_MAX)


# Tokens a block of the step kernel in token tiles, as the tiles rows' alternatives set it.
TILE_TOKENS = 8


def _in_tiles(f, most: int = TILE_TOKENS) -> bool:
    """The step kernel takes the problem in tiles of more than one token, at most ``most``:
    its fields fit, a tile divides the sequence (the batch for sbhd with B > 1: the tiles run
    across it, positions in grid.z) and fits the block and the grid (:func:`token_tile`)."""
    return (_step_kernel_fits(f)
            and step_tile(f.seqlen, f.batch, f.chunks, most, f.sbhd_batches) > 1)


def _past_l2_from_tables(f) -> bool:
    return f.past_l2 and f.pair_per_thread and not f.computed


# The settings a table decides, and what each means:
#   pair_per_thread   rotate-half: a thread owns a chunk of each half (kernel.PAIR_PER_THREAD)
#   streaming         evict-first loads and stores (off: kernel.PLAIN_ACCESSES)
#   table_per_head    cos/sin loaded again for every head (kernel.TABLE_PER_HEAD)
#   flat_index        (b, s, h, chunk) from a flat index by div/mod (kernel.FLAT_INDEX)
#   fp32_angles       computed angles in fp32 (kernel.FP32_ANGLES)
#   memory_order      sbhd: the grid walks the (s, b) tokens in memory order (Plan.fold)
#   index_bits        32- or 64-bit offsets
#   vector_cap        at most this many elements per access (None: the widest that fits)
#   step_kernel       rope_step: one thread per (token, chunk), no loop
#   step_heads        heads per step-kernel thread (a function of the facts, or a number)
#   step_tokens       step kernel: at most this many tokens a block, head blocks first in the
#                     grid (kernel.TOKEN_TILES, token_tile; sbhd with B > 1: the tokens of that
#                     many sequences at one position, kernel.BATCH_TILES); 1: a token a block,
#                     tokens first
#   fixed_switches    the step kernel compiles the problem's switches in (off: reads them)
#   vector            main kernel: the access width (None: the aligned width)
#   unroll            main kernel: heads per thread per step
#   head_splits       main kernel: True: split the heads over grid.z until the blocks cover the
#                     SMs twice; False: no split; a number: that many splits (experiments)
# Rows are checked in order; each setting comes from the first row that gives it and holds.
RULES: tuple[Rule, ...] = (
    Rule("pair per thread in place", "A thread owns both halves",
         lambda f: not f.interleaved and f.in_place, dict(pair_per_thread=True)),
    Rule("pair per thread from tables", "A thread owns both halves",
         lambda f: not f.interleaved and f.tables, dict(pair_per_thread=True)),
    # No settings of their own (the rows kernel, streaming): a tuning table's alternative sets
    # them.
    Rule("out of place from twice the L2: token tiles", "Token tiles",
         lambda f: _tiles_may_take(f) and not f.in_place, {}),
    Rule("in place from twice the L2: token tiles", "Token tiles",
         lambda f: _tiles_may_take(f) and f.in_place, {}),
    Rule("streaming past the L2", "Cache hints", lambda f: f.past_l2, dict(streaming=True)),
    Rule("sbhd in memory order", "sbhd: tokens in memory order",
         lambda f: f.sbhd_batches and f.tokens <= INT32_MAX - MAX_TOKENS_PER_BLOCK,
         dict(memory_order=True)),
    Rule("32-bit offsets where they fit", "32-bit offsets", lambda f: f.extent <= INT32_MAX,
         dict(index_bits=32)),
    Rule("step kernel below the work bound", "The step kernel", _step_kernel_fits,
         dict(step_kernel=_below_work_bound)),
    Rule("several heads per step thread in place", "The step kernel",
         lambda f: f.in_place and f.elem == 2 and f.work >= 2 * f.resident,
         dict(step_heads=_step_heads)),
    Rule("16-bit past the L2: 8-byte accesses, 2 or 4 heads", "Registers",
         lambda f: _past_l2_from_tables(f) and f.elem == 2 and f.vector == 8,
         dict(vector=4, unroll=_fewest_idle_of_2_or_4)),
    Rule("fp32 in place past the L2: 2 heads per step", "Registers",
         lambda f: (_past_l2_from_tables(f) and f.elem == 4 and f.in_place and not f.interleaved
                    and 2 * head_lanes(f.htot, 2, f.chunks) >= f.htot),
         dict(unroll=2)),
    Rule("fp32 out of place past the L2: heads per step from the work", "Per-device tuning",
         lambda f: _past_l2_from_tables(f) and f.elem == 4 and not f.in_place,
         dict(unroll=unroll_from_work)),
    Rule("the default", "The launch plan", always, dict(
        pair_per_thread=False, streaming=False, table_per_head=False, flat_index=False,
        fp32_angles=False, memory_order=False, index_bits=64, vector_cap=None,
        step_kernel=False, step_heads=1, step_tokens=1, fixed_switches=True, vector=None,
        unroll=unroll_from_work, head_splits=True)),
)


def _wide_leaves_fewer_idle(f, unrolls=(2, 4)) -> bool:
    """16-byte accesses with 4 heads per step leave fewer idle head slots than 8-byte accesses
    with any of ``unrolls`` heads per step (72 heads: 0 against 24 for 2 heads and 56 for 4; 32,
    40 or 64 heads: 0 either way)."""
    c = f.aligned_chunks
    return idle_head_slots(f.htot, 4, c) < min(idle_head_slots(f.htot, u, 2 * c) for u in unrolls)


# What a device's tuning table may choose for a row instead of the row's own settings: row name
# -> alternative name -> the settings it gives where the row holds. ``python -m
# ports.harness.tune`` times each against the row's own on the GPU it runs on and writes the
# choices that win to tuning.TUNED_DIR; a GPU of a family without a table runs RULES as they
# are (DESIGN.md, "Per-device tuning").
ALTERNATIVES: dict[str, dict[str, dict]] = {
    "step kernel below the work bound": {
        # Past the bound too (sbhd with B > 1 keeps its bound: the step grid walks one sequence
        # at a time): many short blocks and no loop, the traffic of flash-attn's and inductor's
        # kernels, against the unrolled steps of fewer threads.
        "the step kernel at any size": dict(
            step_kernel=lambda f: not f.sbhd_batches or _below_work_bound(f)),
        "the step kernel at any size for 16-bit data": dict(
            step_kernel=lambda f: (f.elem == 2 and not f.sbhd_batches) or _below_work_bound(f))},
    # flash-attn's launch (8 tokens x 2 heads a program, head blocks first) in the step kernel:
    # one thread per (token, head, chunk of each half), 8 tokens a block (in sbhd with B > 1, 8
    # sequences at one position); the streaming row's accesses or plain ones; in place, the heads
    # a thread the next rows give or 2.
    "out of place from twice the L2: token tiles": {
        "the step kernel in tiles of 8 tokens": dict(step_kernel=_in_tiles,
                                                     step_tokens=TILE_TOKENS),
        "the step kernel in tiles of 8 tokens, plain accesses": dict(
            step_kernel=_in_tiles, step_tokens=TILE_TOKENS, streaming=False)},
    "in place from twice the L2: token tiles": {
        "the step kernel in tiles of 8 tokens": dict(step_kernel=_in_tiles,
                                                     step_tokens=TILE_TOKENS),
        "the step kernel in tiles of 8 tokens, 2 heads a thread": dict(
            step_kernel=_in_tiles, step_tokens=TILE_TOKENS, step_heads=2),
        # in place the tiles lost up to 3% on the H200 below about 4x its L2 (a 134 MB fp32
        # input, a 168 MB fp16 one with k) and 2 heads a thread gained only in 16 bits
        "the step kernel in tiles of 8 tokens from 4x the L2, 2 heads a thread in 16 bits": dict(
            step_kernel=lambda f: f.input_bytes >= 4 * f.l2 and _in_tiles(f),
            step_tokens=TILE_TOKENS, step_heads=lambda f: 2 if f.elem == 2 else 1)},
    "streaming past the L2": {
        "plain accesses": dict(streaming=False),
        "plain accesses out of place": dict(streaming=lambda f: f.in_place),
        "plain accesses for fp32 out of place": dict(
            streaming=lambda f: f.in_place or f.elem != 4)},
    "several heads per step thread in place": {
        **{f"{n} head{'s' * (n > 1)}": dict(step_heads=n) for n in (1, 2, 4)},
        "4 or 2 heads where the blocks hold two warps' threads, whole warps or not": dict(
            step_heads=lambda f: _step_heads(f, whole_warps=False))},
    "16-bit past the L2: 8-byte accesses, 2 or 4 heads": {
        "16-byte accesses, 4 heads": dict(vector=None, unroll=4),
        "16-byte accesses, 2 heads": dict(vector=None, unroll=2),
        "8-byte accesses, 4 heads": dict(vector=4, unroll=4),
        "8-byte accesses, 2 heads": dict(vector=4, unroll=2),
        "16-byte accesses and 4 heads where they leave fewer idle head slots": dict(
            vector=lambda f: None if _wide_leaves_fewer_idle(f) else 4,
            unroll=lambda f: 4 if _wide_leaves_fewer_idle(f) else _fewest_idle_of_2_or_4(f)),
        "4 heads, 16-byte accesses where they leave fewer idle head slots": dict(
            vector=lambda f: None if _wide_leaves_fewer_idle(f, (4,)) else 4, unroll=4)},
    "fp32 in place past the L2: 2 heads per step": {
        "1 head": dict(unroll=1), "4 heads": dict(unroll=4)},
    "fp32 out of place past the L2: heads per step from the work": {
        "1 head": dict(unroll=1), "2 heads": dict(unroll=2)},
}


def with_choices(choices: dict[str, str]) -> tuple[Rule, ...]:
    """RULES with each row named in ``choices`` giving its chosen alternative's settings
    (:data:`ALTERNATIVES`) instead of its own; the same tuple for the same choices."""
    for row, alternative in choices.items():
        if row not in ALTERNATIVES:
            raise ValueError(f"no row {row!r} of plan.RULES has alternatives; rows that have: "
                             f"{', '.join(map(repr, ALTERNATIVES))}")
        if alternative not in ALTERNATIVES[row]:
            raise ValueError(f"row {row!r} has no alternative {alternative!r}; choose from "
                             f"{', '.join(map(repr, ALTERNATIVES[row]))}")
    return _with_choices(tuple(sorted(choices.items())))


@functools.cache
def _with_choices(choices: tuple[tuple[str, str], ...]) -> tuple[Rule, ...]:
    chosen = dict(choices)
    return tuple(
        Rule(f"{rule.name}: {chosen[rule.name]}", rule.section, rule.when,
             ALTERNATIVES[rule.name][chosen[rule.name]]) if rule.name in chosen else rule
        for rule in RULES)


@functools.cache
def device_rules(device_index: int) -> tuple[Rule, ...]:
    """The rules a GPU runs: RULES with its family's tuning table's choices (tuning.py)."""
    return with_choices(tuning.choices(device_index))


def _setting(rules, name: str, f):
    """The value of setting ``name``: the first row of ``rules`` that gives it and holds."""
    for rule in rules:
        if name in rule.settings and rule.when(f):
            value = rule.settings[name]
            return value(f) if callable(value) else value
    raise LookupError(f"no rule gives {name!r}")


def _step_eligible(p: Problem) -> bool:
    """The step kernel's fields are 32-bit and it has no thd search."""
    b_stride, s_stride = p.position_strides
    pos_extent = (p.batch - 1) * abs(b_stride) + (p.seqlen - 1) * abs(s_stride)
    return p.nseq == 0 and max(p.table_rows, abs(p.table_stride), pos_extent) <= INT32_MAX


def choose(p: Problem, operands: list[Operand], *, in_place: bool, backward: bool, cos=None,
           sin=None) -> Plan:
    """The design's plan (:data:`RULES` as the device's tuning table sets them,
    :func:`device_rules`) for problem ``p`` on ``operands``; ``cos``/``sin``: the tables (None:
    computed angles)."""
    return choose_from(device_rules(operands[0].src.get_device()), p, operands,
                       in_place=in_place, backward=backward, cos=cos, sin=sin)


def choose_from(rules, p: Problem, operands: list[Operand], *, in_place: bool, backward: bool,
                cos=None, sin=None) -> Plan:
    """:func:`choose` with another table of rules (ablation.py's)."""
    q = operands[0].src
    device = q.get_device()
    batch, seqlen, head_dim, rotary_dim = p.batch, p.seqlen, p.head_dim, p.rotary_dim
    interleaved, computed = p.interleaved, p.computed
    elem = q.element_size()
    half = rotary_dim // 2
    htot = sum(op.heads for op in operands)
    tokens = batch * seqlen
    extent = 0
    for op in operands:
        for st in (op.src_strides, op.dst_strides):
            extent = max(extent, _max_offset(zip((batch, seqlen, op.heads), st)) + head_dim)
    # The data the call reads, and reads and writes (the cos/sin rows left out), against the L2.
    input_bytes = tokens * htot * head_dim * elem
    data_bytes = input_bytes * (1 if in_place else 2)
    f = SimpleNamespace(
        interleaved=interleaved, computed=computed, tables=not computed, in_place=in_place,
        elem=elem, batch=batch, seqlen=seqlen, tokens=tokens, htot=htot, extent=extent,
        input_bytes=input_bytes, l2=l2_bytes(device), past_l2=data_bytes > l2_bytes(device),
        sbhd_batches=batch > 1 and all(op.src_strides[1] > op.src_strides[0]
                                       for op in operands),
        step_eligible=_step_eligible(p), sms=sm_count(device),
        resident=sm_count(device) * 2048)
    pair = _setting(rules, "pair_per_thread", f)
    flags = ((kernel.TABLE_PER_HEAD if _setting(rules, "table_per_head", f) else 0)
             | (kernel.FP32_ANGLES if _setting(rules, "fp32_angles", f) else 0)
             | (kernel.FLAT_INDEX if _setting(rules, "flat_index", f) else 0)
             | (0 if _setting(rules, "streaming", f) else kernel.PLAIN_ACCESSES))
    # Computed angles: cos/sin rows [R] per token in shared memory (fp32 outputs add their low
    # parts).
    lo = computed and q.dtype == torch.float32 and not flags & kernel.FP32_ANGLES
    angle_bytes = (4 if lo else 2) * rotary_dim * 4 if computed else 0
    tail = head_dim - rotary_dim if not in_place else 0
    units = (half,) if not interleaved else (rotary_dim,)
    units += (tail,) if tail else ()
    strides, addresses = [], []
    for op in operands:
        for t, st in ((op.src, op.src_strides), (op.dst, op.dst_strides)):
            strides += [s for s, n in zip(st, (batch, seqlen, op.heads)) if n > 1]
            addresses.append(t.data_ptr())
    if computed:
        t_elem, t_stride, t_addr, per_chunk = 0, 1, 0, (lambda v: 1)
    else:
        t_elem, t_stride = cos.element_size(), cos.stride(0)
        t_addr = cos.data_ptr() | sin.data_ptr()  # aligned to x iff both are
        if not interleaved and not p.half_table:
            t_addr |= half * t_elem  # second-half rows start R/2 elements in
        per_chunk = (lambda v: v // 2) if interleaved and p.half_table else (lambda v: v)
    minimum = 2 if interleaved else 1
    v = vector_width(elem, units, tuple(strides), tuple(addresses), t_elem, per_chunk,
                     t_stride, t_addr, minimum)
    cap = _setting(rules, "vector_cap", f)
    if cap is not None and v:
        v = max(minimum, min(v, cap))
    if v == 0:
        raise ValueError(
            "interleaved RoPE needs each pair in one aligned access: every stride must be even "
            f"and every tensor (and cos/sin row) {2 * elem}-byte aligned; got strides "
            f"{sorted(set(strides))}")
    split = interleaved or not pair  # a thread per chunk of the R channels
    if split and not interleaved and (rotary_dim + tail) // v > THREADS_PER_BLOCK:
        pair, split = True, False  # rows wider than a block: a thread takes a chunk of each half
    if pair:
        flags |= kernel.PAIR_PER_THREAD
    rot_chunks = (rotary_dim if split else half) // v
    tail_chunks = tail // v
    chunks = rot_chunks + tail_chunks
    fold = batch if _setting(rules, "memory_order", f) else 0
    rows, grid_batch = (tokens, 1) if fold else (seqlen, batch)
    index_bits = f.index_bits = _setting(rules, "index_bits", f)
    table_dtype = torch.float32 if computed else cos.dtype
    f.vector, f.chunks, f.split, f.pair_per_thread = v, chunks, split, pair
    f.aligned_chunks = chunks  # f.chunks at the aligned width, before any narrowing
    f.work = tokens * htot * chunks  # chunk-rows: one thread's unit of work per head
    if _setting(rules, "step_kernel", f):
        # Every (token, head, chunk) its own thread; the heads of a token spread evenly over as
        # few blocks of <= 256 threads as hold them. Rotate-half threads own a chunk of each half.
        step_flags = flags if interleaved else flags | kernel.PAIR_PER_THREAD
        step_rot = rotary_dim // v if interleaved else half // v
        f.step_chunks = step_chunks = step_rot + tail_chunks
        heads = _setting(rules, "step_heads", f)
        switches = (kernel.step_switches(p.positions, p.position_int32, p.half_table, backward)
                    if _setting(rules, "fixed_switches", f) else kernel.RUNTIME_SWITCHES)
        across = f.sbhd_batches
        tile = step_tile(seqlen, batch, step_chunks, _setting(rules, "step_tokens", f), across)
        if tile > 1:
            # head blocks first: grid (head blocks, S / tile, B), across the batch (head blocks,
            # B / tile, S)
            head_blocks = -(-htot // (THREADS_PER_BLOCK // (step_chunks * tile) * heads))
            lanes = -(-htot // (head_blocks * heads))
            tiles = kernel.TOKEN_TILES | (kernel.BATCH_TILES if across else 0)
            grid = ((head_blocks, batch // tile, seqlen) if across
                    else (head_blocks, seqlen // tile, batch))
            name = kernel.step_kernel_name(q.dtype, table_dtype, v, interleaved,
                                           step_flags | tiles, heads, switches)
            return Plan(name, grid, (step_chunks, lanes, tile), 0, v, heads, 32, step_rot,
                        tail_chunks, lanes, 0, step=True)
        head_blocks = step_head_blocks(htot, step_chunks, heads, tokens, f.sms)
        lanes = -(-htot // (head_blocks * heads))
        if head_blocks <= MAX_GRID_Y:
            name = kernel.step_kernel_name(q.dtype, table_dtype, v, interleaved, step_flags,
                                           heads, switches)
            return Plan(name, (seqlen, batch, head_blocks), (step_chunks, lanes, 1), 0, v, heads,
                        32, step_rot, tail_chunks, lanes, 0, step=True)
    narrowed = _setting(rules, "vector", f)
    if narrowed is not None and narrowed != v:
        v = narrowed
        rot_chunks, tail_chunks = (rotary_dim if split else half) // v, tail // v
        chunks = f.chunks = rot_chunks + tail_chunks
    unroll = _setting(rules, "unroll", f)
    if chunks > THREADS_PER_BLOCK:
        raise ValueError(f"head_dim {head_dim} needs {chunks} threads per row, more than a block "
                         f"of {THREADS_PER_BLOCK}")
    lanes = head_lanes(htot, unroll, chunks)
    tokens_per_block = max(1, min(MAX_TOKENS_PER_BLOCK, THREADS_PER_BLOCK // (chunks * lanes),
                                  rows))
    if angle_bytes:
        tokens_per_block = max(1, min(tokens_per_block, SMEM_LIMIT // angle_bytes))
    splits, head_splits = 1, _setting(rules, "head_splits", f)
    if head_splits is True:  # split the heads until the blocks cover the SMs twice
        blocks = -(-rows // tokens_per_block) * grid_batch
        if blocks < 2 * f.sms:
            splits = min(htot, -(-2 * f.sms // blocks))
    elif head_splits:
        splits = min(htot, head_splits)
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
