"""The launch side of the study kernel: the plan (vector width, grid, block) and the launch.

The plan is chosen from the problem on the host, per call, in plain integer arithmetic:

* ``V`` (elements per chunk): the widest power of two up to 16 bytes that divides R/2
  (rotate-half) or R (interleaved), the pass-through tail, every stride of every tensor, and
  keeps every address (tensors and cos/sin rows) aligned to the access it makes.
* ``unroll`` (heads per thread per step) and head splits from the work size: a decode step
  needs many small blocks to cover the SMs, a prefill shape needs few threads with many
  independent loads each.
* ``IDX``: 32-bit offsets when every offset fits, else 64-bit.

The kernel takes one struct argument, packed here with :mod:`struct` and launched with
``cuLaunchKernel`` on torch's current stream: one C call instead of CuPy's per-argument
conversion, which is most of a RawKernel's host time.
"""
from __future__ import annotations

import ctypes
import functools
import struct
import threading
from dataclasses import dataclass

import torch

from ports import _cupy

FILENAME = "rope.cu"
OPTIONS: tuple[str, ...] = ()  # no fast math: accurate sincos, IEEE division and denormals

# Ablation switches (rope.cu's FLAGS); 0 is the shipped design.
RELOAD_TABLE, NO_CACHE_HINTS, ANGLE_FP32, DIVIDE, BOTH_HALVES = 1, 2, 4, 8, 16

CTYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
MAX_GRID_Y = 65535
THREADS_PER_BLOCK = 256
MAX_TOKENS_PER_BLOCK = 64       # blockDim.z limit
# rope.cu is built with __launch_bounds__(256): no block may be larger.
SMEM_LIMIT = 16 * 1024          # computed angles: shared cos/sin rows per block

# Params in rope.cu: the per-call part (9 pointers, pos_add) and the per-problem part
# (16 int64, 14 int32), 264 bytes together.
_DYNAMIC = struct.Struct("<9Qq")
_STATIC = struct.Struct("<16q14i")
PARAMS_SIZE = _DYNAMIC.size + _STATIC.size


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
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    vector: int
    unroll: int
    index_bits: int
    rot_chunks: int
    tail_chunks: int
    heads_per_split: int
    fold: int  # B when the grid walks the (s, b) tokens b-fastest (sbhd), else 0


def kernel_name(dtype: torch.dtype, table_dtype: torch.dtype, vector: int, interleaved: bool,
                computed: bool, index_bits: int, unroll: int, flags: int = 0) -> str:
    """The template instantiation (an NVRTC name expression)."""
    idx = "int" if index_bits == 32 else "long long"
    return (f"study_rope<{CTYPE[dtype]}, {CTYPE[table_dtype]}, {vector}, "
            f"{str(interleaved).lower()}, {str(computed).lower()}, {idx}, {unroll}, {flags}>")


@functools.cache
def _source() -> str:
    return _cupy.read_source(__package__, FILENAME)


@functools.cache
def _function_ptr(device_index: int, name: str) -> int:
    """Compile one instantiation for the device (once) and return its CUfunction."""
    fn = _cupy._load(device_index, _source(), FILENAME, tuple(OPTIONS), (name,))[name]
    return fn.ptr



@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _max_offset(shape_strides) -> int:
    return sum((n - 1) * s for n, s in shape_strides)


def vector_width(elem_size: int, units: tuple[int, ...], strides: tuple[int, ...],
                 addresses: tuple[int, ...], table_elem_size: int, table_per_chunk,
                 table_stride: int, table_address: int, minimum: int) -> int:
    """Widest V (a power of two, V * elem_size <= 16) that divides every unit and stride and
    keeps every access aligned; ``table_per_chunk(V)`` is the cos/sin elements one chunk reads."""
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


def plan(*, operands: list[Operand], batch: int, seqlen: int, head_dim: int, rotary_dim: int,
         interleaved: bool, tables, computed: bool, in_place: bool, flags: int = 0,
         shape_rule: str = "auto", vector_cap: int | None = None,
         index_bits: int | None = None, unroll: int | None = None,
         memory_order: bool = True) -> Plan:
    """Choose the launch for this problem (see the module doc). ``tables`` is
    ``(cos, sin, half_table)`` or ``None``; ``shape_rule``, ``vector_cap``, ``index_bits``,
    ``unroll`` and ``memory_order=False`` force ablations."""
    q = operands[0].src
    elem = q.element_size()
    half = rotary_dim // 2
    # Computed angles: cos/sin rows [R] per token in shared memory (fp32 outputs add their low
    # parts). In place, a rotate-half thread owns both halves: a thread that loads its partner
    # from memory could read it after the partner's owner has overwritten it.
    lo = computed and q.dtype == torch.float32 and not flags & ANGLE_FP32
    angle_bytes = (4 if lo else 2) * rotary_dim * 4 if computed else 0
    if in_place and not interleaved:
        flags |= BOTH_HALVES
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
    split = interleaved or not flags & BOTH_HALVES  # a thread per chunk of the R channels
    if split and not interleaved and (rotary_dim + tail) // v > THREADS_PER_BLOCK:
        flags |= BOTH_HALVES  # rows wider than a block: a thread takes a chunk of each half
        split = False
    rot_chunks = (rotary_dim if split else half) // v
    tail_chunks = tail // v
    chunks = rot_chunks + tail_chunks
    htot = sum(op.heads for op in operands)
    tokens = batch * seqlen
    # sbhd (sequence stride outside the batch stride) with computed angles: walk the tokens in
    # memory order, so the blocks in flight read one dense span instead of B interleaved ones
    # (4-6% faster on H100). With tables it was mixed (3-10% slower with 16-bit tables or bf16 x
    # and cold fp32 tables, 4% faster for fp32 x and tables): there each sequence goes in turn.
    fold = batch if (memory_order and computed and batch > 1
                     and tokens <= _cupy.INT32_MAX - MAX_TOKENS_PER_BLOCK  # t stays an int
                     and all(op.src_strides[1] > op.src_strides[0] for op in operands)) else 0
    rows, grid_batch = (tokens, 1) if fold else (seqlen, batch)
    resident = sm_count(q.get_device()) * 2048

    work = tokens * htot * chunks  # chunk-rows: one thread's unit of work per head
    if unroll is not None:
        pass
    elif shape_rule == "fixed":     # ablation: the prefill shape for every size
        unroll = 4
    else:
        # Measured on H100: 4 heads per step once the work is 8x the resident threads. Between
        # 2x and 8x, given tables with a thread per chunk take one head per step at 6 blocks per
        # SM (rope.cu's STUDY_MIN_BLOCKS; 32.9 -> 30.8 us on 1x4096x32x128 bf16), the others
        # 2 heads (one head without the register cap was 3-20% slower for them).
        capped = not computed and split
        unroll = (4 if work >= 8 * resident else (1 if capped else 2) if work >= 2 * resident
                  else 1)
    if chunks > THREADS_PER_BLOCK:
        raise ValueError(f"head_dim {head_dim} needs {chunks} threads per row, more than a block "
                         f"of {THREADS_PER_BLOCK}")
    lanes = max(1, min(-(-htot // unroll), THREADS_PER_BLOCK // chunks))
    tokens_per_block = max(1, min(MAX_TOKENS_PER_BLOCK, THREADS_PER_BLOCK // (chunks * lanes),
                                  rows))
    if angle_bytes:
        tokens_per_block = max(1, min(tokens_per_block, SMEM_LIMIT // angle_bytes))
    splits = 1
    if shape_rule != "fixed":
        blocks = -(-rows // tokens_per_block) * grid_batch
        if blocks < 2 * sm_count(q.get_device()):
            splits = min(htot, -(-2 * sm_count(q.get_device()) // blocks))
    heads_per_split = -(-htot // splits)
    splits = -(-htot // heads_per_split)
    lanes = min(lanes, heads_per_split)

    if index_bits is None:
        extent = 0
        for op in operands:
            for t, st in ((op.src, op.src_strides), (op.dst, op.dst_strides)):
                extent = max(extent, _max_offset(zip((batch, seqlen, op.heads), st)) + head_dim)
        index_bits = 32 if extent <= _cupy.INT32_MAX else 64
    name = kernel_name(q.dtype, tables[0].dtype if tables is not None else torch.float32,
                       v, interleaved, computed, index_bits, unroll, flags)
    grid = (-(-rows // tokens_per_block), grid_batch, splits)
    block = (chunks, lanes, tokens_per_block)
    smem = angle_bytes * tokens_per_block
    return Plan(name, grid, block, smem, v, unroll, index_bits, rot_chunks, tail_chunks,
                heads_per_split, fold)


@dataclass(frozen=True)
class Launch:
    """One launch, ready but for its pointers: the kernel, its shape and the per-problem bytes."""

    function: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    static: bytes
    device: int
    plan: Plan
    dims: tuple[int, ...]  # grid, block and shared memory, as cuLaunchKernel takes them


def prepare(p: Plan, operands: list[Operand], *, seqlen: int, half: int, half_table: bool,
            table_rows: int, table_stride: int, pos_mode: int, pos_strides: tuple[int, int],
            pos_int32: bool, nseq: int, backward: bool) -> Launch:
    """Compile (once) and pack the per-problem parameters of plan ``p``."""
    q = operands[0]
    k = operands[1] if len(operands) > 1 else None
    zero3 = (0, 0, 0)
    qs, qd = q.src_strides, q.dst_strides
    ks, kd = (k.src_strides, k.dst_strides) if k is not None else (zero3, zero3)
    static = _STATIC.pack(
        qs[0], ks[0], qs[1], ks[1], qs[2], ks[2], qd[0], kd[0], qd[1], kd[1], qd[2], kd[2],
        pos_strides[0], pos_strides[1], table_rows, table_stride,
        q.heads, k.heads if k is not None else 0, seqlen, nseq, p.rot_chunks, p.tail_chunks,
        p.heads_per_split, pos_mode, int(pos_int32), int(half_table), half, int(backward),
        p.fold, 0)
    device = q.src.get_device()
    _ONE_DEVICE[0] = torch.cuda.device_count() == 1
    return Launch(_function_ptr(device, p.kernel), p.grid, p.block, p.shared_mem, static,
                  device, p, (*p.grid, *p.block, p.shared_mem))


_local = threading.local()


def _param_buffer():
    """A per-thread parameter block and the one-entry argument array pointing at it."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = ctypes.create_string_buffer(PARAMS_SIZE)
        _local.argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
        _local.argv_ptr = ctypes.addressof(_local.argv)
        _local.static = None
    return buf


def launch(lc: Launch, q_in: int, k_in: int, q_out: int, k_out: int, cos: int, sin: int,
           inv_freq: int, pos: int, cu_seqlens: int, pos_add: int) -> None:
    """Pack the pointers (and the per-problem bytes if they changed) and launch on torch's
    current stream. cuLaunchKernel copies the parameters, so the buffer is reused at once."""
    try:
        buf = _local.buf
    except AttributeError:
        buf = _param_buffer()
    _DYNAMIC.pack_into(buf, 0, q_in, k_in, q_out, k_out, cos, sin, inv_freq, pos, cu_seqlens,
                       pos_add)
    if _local.static is not lc.static:
        buf[_DYNAMIC.size:PARAMS_SIZE] = lc.static
        _local.static = lc.static
    device = lc.device
    stream = _raw_stream(device)
    if _ONE_DEVICE[0] or torch.cuda.current_device() == device:
        _launch_kernel(lc.function, *lc.dims, stream, _local.argv_ptr, 0)
    else:
        with torch.cuda.device(device):
            _launch_kernel(lc.function, *lc.dims, stream, _local.argv_ptr, 0)


def _raw_stream(device: int) -> int:
    global _raw_stream
    try:
        _raw_stream = torch._C._cuda_getCurrentRawStream
    except AttributeError:
        _raw_stream = _cupy._current_raw_stream
    return _raw_stream(device)


def _launch_kernel(*args):
    global _launch_kernel
    _launch_kernel = _driver().launchKernel
    return _launch_kernel(*args)


_ONE_DEVICE = [True]


@functools.lru_cache(maxsize=1)
def _driver():
    _cupy.cupy()  # a clear error if CuPy is missing
    from cupy_backends.cuda.api import driver

    return driver
