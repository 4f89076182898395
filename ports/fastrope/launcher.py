"""The launch: rope.cu's ``Params`` packed on the host, one ``cuLaunchKernel`` per call.

The kernel takes one struct argument. :func:`prepare` packs its per-problem part (strides, sizes,
the plan's fields) once per input geometry into a :class:`Launch`; :func:`launch` packs the
per-call part (pointers and the scalar position offset) with :mod:`struct` into a per-thread
buffer and calls ``cuLaunchKernel`` on torch's current stream: one C call instead of CuPy's
per-argument conversion, which is most of a RawKernel's host time.

A driver launch runs in the calling thread's current CUDA context, and a thread that has made no
CUDA call yet (autograd's backward thread, a user's worker thread) has none. :func:`launch`
makes the tensor's device's primary context (the one torch's runtime uses) current when it is
not, and restores the thread's context after the launch.
"""
from __future__ import annotations

import ctypes
import functools
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ports import _cupy
from ports.fastrope import kernel
from ports.fastrope.plan import Operand, Plan
from ports.fastrope.problem import Problem

# Params in rope.cu: the per-call part (9 pointers, the int offset) and the per-problem part
# (16 int64, 14 int32), 264 bytes together. The step kernel's StepParams shares the per-call
# part; its per-problem part is 24 int32 (176 bytes together).
_DYNAMIC = struct.Struct("<9Qq")
_STATIC = struct.Struct("<16q14i")
_STEP_STATIC = struct.Struct("<24i")
PARAMS_SIZE = _DYNAMIC.size + _STATIC.size

# torch's current stream on a device, as a raw pointer (CuPy's helper where torch lacks the hook).
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) \
    or _cupy._current_raw_stream


@functools.cache
def _driver():
    _cupy.cupy()  # a clear error if CuPy is missing
    from cupy_backends.cuda.api import driver

    return driver


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
    context: int           # the device's primary context (CUcontext)
    launch_kernel: Callable  # CuPy's bindings of cuLaunchKernel, cuCtxGetCurrent, cuCtxSetCurrent
    current_context: Callable
    set_context: Callable


def prepare(p: Plan, problem: Problem, operands: list[Operand], *, backward: bool,
            function: int | None = None) -> Launch:
    """Compile (once) and pack the per-problem parameters of plan ``p`` for ``problem`` on
    ``operands`` (rope.cu's Params, or StepParams for the step kernel). ``function``: a
    CUfunction compiled elsewhere (an experiment's build of rope.cu) instead of the design's."""
    half, position_strides = problem.rotary_dim // 2, problem.position_strides
    table_rows, table_stride = problem.table_rows, problem.table_stride
    form, int32, half_table = problem.positions, problem.position_int32, problem.half_table
    q = operands[0]
    k = operands[1] if len(operands) > 1 else None
    zero3 = (0, 0, 0)
    qs, qd = q.src_strides, q.dst_strides
    ks, kd = (k.src_strides, k.dst_strides) if k is not None else (zero3, zero3)
    strides = (qs[0], ks[0], qs[1], ks[1], qs[2], ks[2], qd[0], kd[0], qd[1], kd[1], qd[2], kd[2])
    kh = k.heads if k is not None else 0
    if p.step:
        static = _STEP_STATIC.pack(
            *strides, *position_strides, table_rows, table_stride, q.heads, kh, p.rot_chunks, half,
            int(form), int(int32), int(half_table), int(backward))
    else:
        static = _STATIC.pack(
            *strides, *position_strides, table_rows, table_stride, q.heads, kh, problem.seqlen,
            problem.nseq, p.rot_chunks, p.tail_chunks, p.heads_per_split, int(form),
            int(int32), int(half_table), half, int(backward), p.fold, 0)
    device = q.src.get_device()
    driver = _driver()
    if function is None:
        function = kernel.function_ptr(device, p.kernel)
    return Launch(function, p.grid, p.block, p.shared_mem, static,
                  device, p, (*p.grid, *p.block, p.shared_mem), primary_context(device),
                  driver.launchKernel, driver.ctxGetCurrent, driver.ctxSetCurrent)


@functools.cache
def primary_context(device: int) -> int:
    """Device ``device``'s primary context, retained once per process (as torch retains it)."""
    _driver()  # CuPy, and with it an initialised driver
    libcuda = ctypes.CDLL("libcuda.so.1")
    handle, context = ctypes.c_int(), ctypes.c_void_p()
    for name, args in (("cuDeviceGet", (ctypes.byref(handle), device)),
                       ("cuDevicePrimaryCtxRetain", (ctypes.byref(context), handle))):
        status = getattr(libcuda, name)(*args)
        if status:
            raise RuntimeError(f"{name} failed for cuda:{device} (CUresult {status})")
    return context.value


_local = threading.local()


def _param_buffer():
    """A per-thread parameter block and the one-entry argument array pointing at it."""
    buf = _local.buf = ctypes.create_string_buffer(PARAMS_SIZE)
    _local.argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
    _local.argv_ptr = ctypes.addressof(_local.argv)
    _local.static = None
    return buf


def replay_words(lc: Launch, group: tuple[int, ...]) -> list[int]:
    """``lc`` as replay.cpp's kernels read it: the CUfunction, grid, block, shared memory, the
    inputs it rotates (``group``: 0 for q, 1 for k; -1 for none) and the per-problem bytes as
    little-endian int64 words (their length first)."""
    static = lc.static + bytes(-len(lc.static) % 8)
    return [lc.function, *lc.grid, *lc.block, lc.shared_mem, group[0],
            group[1] if len(group) > 1 else -1, len(static) // 8,
            *struct.unpack(f"<{len(static) // 8}q", static)]


def launch(lc: Launch, q_in: int, k_in: int, q_out: int, k_out: int, cos: int, sin: int,
           inv_freq: int, position_tensor: int, cu_seqlens: int, offset: int) -> None:
    """Pack the pointers (and the per-problem bytes if they changed) and launch on torch's
    current stream. cuLaunchKernel copies the parameters, so the buffer is reused at once."""
    try:
        buf = _local.buf
    except AttributeError:
        buf = _param_buffer()
    _DYNAMIC.pack_into(buf, 0, q_in, k_in, q_out, k_out, cos, sin, inv_freq, position_tensor,
                       cu_seqlens, offset)
    if _local.static is not lc.static:
        buf[_DYNAMIC.size:_DYNAMIC.size + len(lc.static)] = lc.static
        _local.static = lc.static
    stream = _current_raw_stream(lc.device)
    current = lc.current_context()
    if current == lc.context:
        lc.launch_kernel(lc.function, *lc.dims, stream, _local.argv_ptr, 0)
        return
    lc.set_context(lc.context)  # the kernel belongs to its device's context
    try:
        lc.launch_kernel(lc.function, *lc.dims, stream, _local.argv_ptr, 0)
    finally:
        lc.set_context(current)
