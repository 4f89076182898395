"""The torch -> CuPy launch helper every CuPy port uses.

* Zero-copy: kernels get raw device pointers (``numpy.uint64(t.data_ptr())``), so any torch dtype
  works, bf16 included (CuPy has no bf16 dtype; the kernel reinterprets the bits).
* Launches on torch's *current* stream and device (an ``ExternalStream`` per torch stream).
* Scalars are passed as explicit NumPy types (:func:`i32`, :func:`i64`, :func:`f32`); a bare
  Python int would be sent as 64 bits and silently misread by an ``int`` parameter.
* Modules are compiled once per (device, source, options, name expressions) with NVRTC, straight
  to a cubin for the device's architecture, and cached. We call NVRTC ourselves rather than
  through ``cupy.RawModule`` because CuPy appends ``-ftz=true`` to every compile, which would
  change the originals' fp32 denormal behaviour (nvcc's default is ``-ftz=false``).
* Host-side checks (:func:`check_cuda`, :func:`check_contiguous`, ..., beside the dtype and rank
  checks of :mod:`reference.vocabulary`) raise clear Python exceptions before any launch: a kernel
  fault would poison the CUDA context for every later caller.
"""
from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Sequence

import numpy as np
import torch

from reference.vocabulary import INT32_MAX, check_tensor
# Re-exported for callers that still import them from here; new code imports reference.vocabulary.
from reference.vocabulary import check_dtype, check_rank  # noqa: F401

_cupy_module = None
_cupy_import_error: BaseException | None = None


def cupy():
    """The cupy module, imported on first use; a clear RuntimeError if it is missing."""
    global _cupy_module, _cupy_import_error
    if _cupy_module is None:
        if _cupy_import_error is not None:
            raise RuntimeError(_missing_cupy_message()) from _cupy_import_error
        try:
            import cupy as cp
        except Exception as exc:  # ImportError, or a CUDA library that fails to load
            _cupy_import_error = exc
            raise RuntimeError(_missing_cupy_message()) from exc
        _cupy_module = cp
    return _cupy_module


def _missing_cupy_message() -> str:
    return ("the CuPy ports need CuPy for the CUDA major that torch uses: pip install -e "
            "'.[cuda13]' (or '.[cuda12]'); torch.version.cuda is " + str(torch.version.cuda))


# ---- scalars --------------------------------------------------------------------------------
def i32(value: int) -> np.int32:
    if not -(2**31) <= value <= INT32_MAX:
        raise OverflowError(f"{value} does not fit a 32-bit int kernel argument")
    return np.int32(value)


def i64(value: int) -> np.int64:
    return np.int64(value)


def f32(value: float) -> np.float32:
    return np.float32(value)


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A device pointer argument (``0`` for ``None``)."""
    return np.uint64(0 if t is None else t.data_ptr())


# ---- host-side checks -----------------------------------------------------------------------
def check_cuda(*named: tuple[str, torch.Tensor]) -> int:
    """Every tensor is a CUDA tensor, all on one device; returns that device's index."""
    index = None
    for name, t in named:
        check_tensor(t, name)
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor (this port launches a CuPy kernel), "
                             f"got a tensor on {t.device}")
        if index is None:
            index = t.get_device()
        elif t.get_device() != index:
            raise ValueError(f"{name} is on {t.device} but the other tensors are on cuda:{index}")
    return index


def check_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the original indexes it densely); got "
                         f"strides {t.stride()} for shape {tuple(t.shape)}; call .contiguous()")


def check_aligned(t: torch.Tensor, name: str, nbytes: int) -> None:
    if t.data_ptr() % nbytes:
        raise ValueError(f"{name} must be {nbytes}-byte aligned for {nbytes}-byte vector "
                         f"loads/stores; its address is {t.data_ptr():#x} (a view with an offset?)")


def check_index_fits(count: int, what: str, limit: int = INT32_MAX) -> None:
    """Refuse sizes whose largest offset would overflow the original's index type."""
    if count > limit:
        raise NotImplementedError(
            f"{what} is {count}, past {limit}: the original computes it in 32-bit ints and would "
            "overflow (out-of-bounds access); this port refuses such inputs")


def max_offset(t: torch.Tensor) -> int:
    """Largest element offset a strided walk over t reaches (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))


# ---- compile and launch -----------------------------------------------------------------------
def read_source(package: str, filename: str) -> str:
    """Kernel source shipped as package data beside its port."""
    return importlib.resources.files(package).joinpath(filename).read_text()


def cuda_include_dirs() -> list[str]:
    """Where NVRTC finds cuda_fp16.h / cuda_bf16.h: the toolkit, or the pip CUDA headers."""
    import os

    dirs = []
    cuda_path = None
    try:
        from cupy import _environment

        cuda_path = _environment.get_cuda_path()
    except Exception:
        cuda_path = os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if cuda_path and os.path.isdir(os.path.join(cuda_path, "include")):
        dirs.append(os.path.join(cuda_path, "include"))
    try:  # nvidia-cuda-runtime / nvidia-cuda-nvrtc wheels ship the headers under nvidia/cu*/include
        import nvidia

        for root in nvidia.__path__:
            for sub in sorted(os.listdir(root)):
                inc = os.path.join(root, sub, "include")
                if sub.startswith("cu") and os.path.isfile(os.path.join(inc, "cuda_fp16.h")):
                    dirs.append(inc)
    except Exception:
        pass
    return dirs


def compile_source(source: str, *, filename: str, options: Sequence[str],
                   name_expressions: Sequence[str], arch: str, method: str = "cubin"
                   ) -> tuple[bytes, dict[str, str]]:
    """NVRTC-compile ``source`` for ``arch`` (e.g. ``sm_90``); needs no GPU.

    Returns the cubin (or PTX) and a map from each name expression to its lowered name.
    """
    compiler = cupy().cuda.compiler
    flags = [*options, f"--gpu-architecture={arch}", "-std=c++17"]
    flags += [f"-I{d}" for d in cuda_include_dirs()]
    program = compiler._NVRTCProgram(source, filename, name_expressions=list(name_expressions) or None,
                                     method=method)
    binary, mapping = program.compile(tuple(flags))
    return binary, dict(mapping or {})


class CudaModule:
    """One ``.cu`` file of a port, compiled per device on first use.

    ``kernels`` are the names launched: plain ``extern "C"`` names or template name expressions
    such as ``"apex_fwd<float>"`` (compiled through NVRTC name expressions).
    """

    def __init__(self, package: str, filename: str, *, kernels: Sequence[str],
                 options: Sequence[str] = ()):
        self.package = package
        self.filename = filename
        self.kernels = tuple(kernels)
        self.options = tuple(options)
        self._per_device: dict[int, dict] = {}

    @functools.cached_property
    def source(self) -> str:
        return read_source(self.package, self.filename)

    def function(self, name: str, device_index: int):
        """The compiled kernel ``name`` on device ``device_index`` (compiled once, then cached)."""
        functions = self._per_device.get(device_index)
        if functions is None:
            functions = load(device_index, self.source, self.filename, self.options, self.kernels)
            self._per_device[device_index] = functions
        return functions[name]


@functools.lru_cache(maxsize=None)
def load(device_index: int, source: str, filename: str, options: tuple[str, ...],
         kernels: tuple[str, ...]) -> dict:
    """CUDA ``source`` compiled for device ``device_index`` with NVRTC ``options`` (once per
    argument set): its ``kernels`` (names or template name expressions) as CuPy functions."""
    cp = cupy()
    major, minor = torch.cuda.get_device_capability(device_index)
    templated = [k for k in kernels if "<" in k]
    binary, lowered = compile_source(source, filename=filename, options=options,
                                     name_expressions=templated, arch=f"sm_{major}{minor}")
    with cp.cuda.Device(device_index):
        module = cp.cuda.function.Module()
        module.load(binary)
        return {k: module.get_function(lowered.get(k, k)) for k in kernels}


_load = load  # the name callers used before ``load`` was public


def _current_raw_stream(device_index: int) -> int:
    """torch's current stream on the device, as a raw pointer (cheap; no Stream object)."""
    try:
        return torch._C._cuda_getCurrentRawStream(device_index)
    except AttributeError:  # older or newer torch without the private hook
        return torch.cuda.current_stream(device_index).cuda_stream


_streams: dict[tuple[int, int], object] = {}


def _external_stream(stream_ptr: int, device_index: int):
    """A CuPy view of a raw stream pointer (cached: creating one costs microseconds)."""
    key = (stream_ptr, device_index)
    stream = _streams.get(key)
    if stream is None:
        import warnings

        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it is still the
            warnings.simplefilter("ignore", DeprecationWarning)  # way to wrap a raw pointer
            stream = _streams[key] = cupy().cuda.ExternalStream(stream_ptr, device_index)
    return stream


@functools.lru_cache(maxsize=1)
def _single_device() -> bool:
    return torch.cuda.device_count() == 1


def launch(module: CudaModule, name: str, device_index: int, grid: tuple[int, ...],
           block: tuple[int, ...], args: tuple, shared_mem: int = 0) -> None:
    """Launch ``name`` on torch's current stream of device ``device_index``."""
    if min(grid) <= 0:
        raise ValueError(f"empty grid {grid}: callers must return early on empty inputs")
    fn = module.function(name, device_index)
    stream = _external_stream(_current_raw_stream(device_index), device_index)
    cp = _cupy_module or cupy()
    if _single_device() or cp.cuda.runtime.getDevice() == device_index:
        fn(grid, block, args, shared_mem=shared_mem, stream=stream)
    else:  # the kernel belongs to that device's context
        with cp.cuda.Device(device_index):
            fn(grid, block, args, shared_mem=shared_mem, stream=stream)
