"""rope.cu's kernel as the host sees it: its template instantiations, its switches, its compile.

The kernel is one template, ``study_rope<T, TT, V, INTERLEAVED, COMPUTED, IDX, UNROLL,
FLAGS>``, beside the step kernel for small and mid-sized problems, ``rope_step<T, TT, V,
INTERLEAVED, FLAGS, HEADS, SWITCHES>``. :func:`kernel_name` and :func:`step_kernel_name` spell an
instantiation as the NVRTC name expression that compiles it; :func:`function_ptr` compiles it (once
per device) for the launcher.
"""
from __future__ import annotations

import functools

import torch

from ports import _cupy

FILENAME = "rope.cu"
OPTIONS: tuple[str, ...] = ()  # no fast math: accurate sincos, IEEE division and denormals

# rope.cu's FLAGS template argument: each switches one idea of the design off (0: the design).
# BOTH_HALVES is also what in-place calls and rows wider than a block use, NO_CACHE_HINTS what
# calls whose data fits in the L2 use (plan.py sets them).
RELOAD_TABLE = 1      # load cos/sin again for every head instead of once per token
NO_CACHE_HINTS = 2    # plain loads/stores instead of streaming (evict-first) ones
ANGLE_FP32 = 4        # computed angles: fp32 pos * inv_freq and sincosf
DIVIDE = 8            # recover (b, s, h, chunk) from a flat index with div/mod per head
BOTH_HALVES = 16      # rotate-half: a thread owns a chunk of each half (no partner loads)

# The element type T (and table type TT) as rope.cu spells it.
CTYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}


def kernel_name(dtype: torch.dtype, table_dtype: torch.dtype, vector: int, interleaved: bool,
                computed: bool, index_bits: int, unroll: int, flags: int = 0) -> str:
    """The template instantiation (an NVRTC name expression)."""
    idx = "int" if index_bits == 32 else "long long"
    return (f"study_rope<{CTYPE[dtype]}, {CTYPE[table_dtype]}, {vector}, "
            f"{str(interleaved).lower()}, {str(computed).lower()}, {idx}, {unroll}, {flags}>")


# The step kernel's SWITCHES argument that reads the problem's switches at run time (the
# runtime_switches ablation); step_switches gives the compiled-in value of one problem.
RUNTIME_SWITCHES = -1


def step_switches(pos_mode: int, pos_int32: bool, half_table: bool, backward: bool) -> int:
    """rope.cu's StepArgs<SWITCHES> for one problem and direction: the position form (0: 0..S-1,
    1: per-sequence offsets, 2: ids), int32 ids, [L, R/2] tables and the backward, as one int."""
    if pos_mode not in (0, 1, 2):
        raise ValueError(f"pos_mode must be 0, 1 or 2, got {pos_mode!r}")
    return pos_mode | int(pos_int32) << 2 | int(half_table) << 3 | int(backward) << 4


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
# every FLAGS switch, and the step kernel with its switches compiled in and read at run time.
# At run time each launch compiles only its own instantiation.
COMPILE_CHECKED = tuple(
    kernel_name(dt, torch.float32, _full_width(dt), interleaved, computed, 32, 4)
    for dt in CTYPE for interleaved in (False, True) for computed in (False, True)
) + (kernel_name(torch.bfloat16, torch.bfloat16, 8, False, False, 64, 1),
     kernel_name(torch.float16, torch.float16, 2, True, False, 32, 2),
     kernel_name(torch.bfloat16, torch.float32, 8, False, False, 32, 4,
                 RELOAD_TABLE | NO_CACHE_HINTS | DIVIDE),
     kernel_name(torch.float32, torch.float32, 4, False, True, 64, 1, ANGLE_FP32),
     kernel_name(torch.bfloat16, torch.bfloat16, 8, False, False, 32, 4, 0),
     kernel_name(torch.float16, torch.float32, 8, False, True, 32, 2, BOTH_HALVES),
     step_kernel_name(torch.bfloat16, torch.bfloat16, 8, False, BOTH_HALVES, 1,
                      step_switches(1, False, False, False)),
     step_kernel_name(torch.float32, torch.float32, 4, True, 0, 4,
                      step_switches(2, True, True, True)),
     step_kernel_name(torch.float16, torch.float32, 4, False, BOTH_HALVES | NO_CACHE_HINTS, 2,
                      step_switches(0, False, True, False)),
     step_kernel_name(torch.bfloat16, torch.float32, 8, False, BOTH_HALVES))
MODULE = _cupy.CudaModule(__package__, FILENAME, kernels=COMPILE_CHECKED, options=OPTIONS)


@functools.cache
def function_ptr(device_index: int, name: str) -> int:
    """Compile one instantiation for the device (once) and return its CUfunction."""
    fn = _cupy._load(device_index, MODULE.source, FILENAME, OPTIONS, (name,))[name]
    return fn.ptr
