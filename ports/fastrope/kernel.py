"""rope.cu's kernel as the host sees it: its template instantiations, its switches, its compile.

The kernel is one template, ``rope_rows<T, TT, V, INTERLEAVED, COMPUTED, IDX, UNROLL,
FLAGS>``, beside the step kernel for small and mid-sized problems, ``rope_step<T, TT, V,
INTERLEAVED, FLAGS, HEADS, SWITCHES>``. :func:`kernel_name` and :func:`step_kernel_name` spell an
instantiation as the NVRTC name expression that compiles it; :func:`function_ptr` compiles it (once
per device) for the launcher.
"""
from __future__ import annotations

import functools

import torch

from ports import _cupy
from ports.fastrope.problem import Positions

FILENAME = "rope.cu"
OPTIONS: tuple[str, ...] = ()  # no fast math: accurate sincos, IEEE division and denormals

# rope.cu's FLAGS template argument: each bit chooses between two ways of doing one thing, both
# of them meaningful; plan.py's rules set them per problem (the design sets PLAIN_ACCESSES where
# the data fits in the L2 and PAIR_PER_THREAD in place and from tables; TOKEN_TILES where a
# GPU's tuning table chooses the step kernel in token tiles; the others only ablations).
TABLE_PER_HEAD = 1    # on: cos/sin loaded again for every head; off: once per token
PLAIN_ACCESSES = 2    # on: plain loads/stores; off: streaming (evict-first) ones
FP32_ANGLES = 4       # computed angles: on: fp32 pos * inv_freq and sincosf; off: fp64
FLAT_INDEX = 8        # on: (b, s, h, chunk) from a flat index by div/mod per head; off: walked
PAIR_PER_THREAD = 16  # rotate-half: on: a thread owns a chunk of each half; off: one half and
                      # loads its partners
TOKEN_TILES = 32      # step kernel: on: grid (head blocks, S / T, B), T tokens a block; off:
                      # grid (S, B, head blocks), one token a block
BATCH_TILES = 64      # with TOKEN_TILES: on: grid (head blocks, B / T, S), a block one position
                      # of T sequences (sbhd with B > 1: consecutive in memory); off: as above
FLAGS = (TABLE_PER_HEAD | PLAIN_ACCESSES | FP32_ANGLES | FLAT_INDEX | PAIR_PER_THREAD | TOKEN_TILES
         | BATCH_TILES)

# The element type T (and table type TT) as rope.cu spells it.
CTYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}


def kernel_name(dtype: torch.dtype, table_dtype: torch.dtype, vector: int, interleaved: bool,
                computed: bool, index_bits: int, unroll: int, flags: int = 0) -> str:
    """The template instantiation (an NVRTC name expression)."""
    idx = "int" if index_bits == 32 else "long long"
    return (f"rope_rows<{CTYPE[dtype]}, {CTYPE[table_dtype]}, {vector}, "
            f"{str(interleaved).lower()}, {str(computed).lower()}, {idx}, {unroll}, {flags}>")


# The step kernel's SWITCHES argument that reads the problem's switches at run time (the
# runtime_switches ablation); step_switches gives the compiled-in value of one problem.
RUNTIME_SWITCHES = -1


def step_switches(positions: Positions, position_int32: bool, half_table: bool,
                  backward: bool) -> int:
    """rope.cu's StepArgs<SWITCHES> for one problem and direction: the position form
    (:class:`~ports.fastrope.problem.Positions`), int32 ids or offsets, [L, R/2] tables and the
    backward, as one int."""
    if positions not in tuple(Positions):
        raise ValueError(f"positions must be one of {[int(m) for m in Positions]}, got "
                         f"{positions!r}")
    return int(positions) | int(position_int32) << 2 | int(half_table) << 3 | int(backward) << 4


def step_kernel_name(dtype: torch.dtype, table_dtype: torch.dtype, vector: int,
                     interleaved: bool, flags: int = 0, heads: int = 1,
                     switches: int = RUNTIME_SWITCHES) -> str:
    """The step kernel's instantiation, ``rope_step<T, TT, V, INTERLEAVED, FLAGS, HEADS,
    SWITCHES>`` (``heads``: heads per thread; ``switches``: :func:`step_switches`, or
    RUNTIME_SWITCHES)."""
    return (f"rope_step<{CTYPE[dtype]}, {CTYPE[table_dtype]}, {vector}, "
            f"{str(interleaved).lower()}, {flags}, {heads}, {switches}>")


def _full_width(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


# The instantiations the sm_90 compile test (tests/test_compile_cuda.py) builds without a GPU:
# every dtype x style x angle source at 16-byte width, then 64-bit offsets, narrow vectors and
# every FLAGS bit, and the step kernel with its switches compiled in and read at run time.
# At run time each launch compiles only its own instantiation.
COMPILE_CHECKED = tuple(
    kernel_name(dt, torch.float32, _full_width(dt), interleaved, computed, 32, 4)
    for dt in CTYPE for interleaved in (False, True) for computed in (False, True)
) + (kernel_name(torch.bfloat16, torch.bfloat16, 8, False, False, 64, 1),
     kernel_name(torch.float16, torch.float16, 2, True, False, 32, 2),
     kernel_name(torch.bfloat16, torch.float32, 8, False, False, 32, 4,
                 TABLE_PER_HEAD | PLAIN_ACCESSES | FLAT_INDEX),
     kernel_name(torch.float32, torch.float32, 4, False, True, 64, 1, FP32_ANGLES),
     kernel_name(torch.bfloat16, torch.bfloat16, 8, False, False, 32, 4, 0),
     kernel_name(torch.float16, torch.float32, 8, False, True, 32, 2, PAIR_PER_THREAD),
     step_kernel_name(torch.bfloat16, torch.bfloat16, 8, False, PAIR_PER_THREAD, 1,
                      step_switches(Positions.OFFSETS, False, False, False)),
     step_kernel_name(torch.float32, torch.float32, 4, True, 0, 4,
                      step_switches(Positions.IDS, True, True, True)),
     step_kernel_name(torch.float16, torch.float32, 4, False, PAIR_PER_THREAD | PLAIN_ACCESSES, 2,
                      step_switches(Positions.ARANGE, False, True, False)),
     step_kernel_name(torch.bfloat16, torch.float32, 8, False, PAIR_PER_THREAD),
     step_kernel_name(torch.bfloat16, torch.bfloat16, 8, False,
                      PAIR_PER_THREAD | PLAIN_ACCESSES | TOKEN_TILES, 1,
                      step_switches(Positions.ARANGE, False, True, False)),
     step_kernel_name(torch.float32, torch.float32, 4, False,
                      PAIR_PER_THREAD | TOKEN_TILES | BATCH_TILES, 2,
                      step_switches(Positions.OFFSETS, False, True, False)))
MODULE = _cupy.CudaModule(__package__, FILENAME, kernels=COMPILE_CHECKED, options=OPTIONS)


@functools.cache
def function_ptr(device_index: int, name: str) -> int:
    """Compile one instantiation for the device (once) and return its CUfunction."""
    fn = _cupy.load(device_index, MODULE.source, FILENAME, OPTIONS, (name,))[name]
    return fn.ptr
