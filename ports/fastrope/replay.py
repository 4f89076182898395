"""replay.cpp: the C++ kernels of fastrope's mutating ops on CUDA tensors, built and loaded.

``fastrope::rope_`` and ``fastrope::rope_out`` are what a compiled graph calls for
``apply_rope_inplace`` and ``apply_rope``. On CUDA tensors their kernels are C++ (replay.cpp):
a call whose input key was planned before is made again with no Python (its launches, packed
and launched on torch's current stream); any other call runs the Python implementation
(ops.py's ``plan_rope_`` and ``plan_rope_out``), which validates, plans and launches, and hands
its launches back to be replayed. ``torch.ops.fastrope.replay_counts()`` gives
``[replayed, planned]``, the calls of each kind since the process began.

:func:`load` builds replay.cpp with ``torch.utils.cpp_extension`` once per source and torch (in
torch's extension cache, ``TORCH_EXTENSIONS_DIR``; a C++ compiler, ninja (a dependency) and the
CUDA headers (the toolkit's, or Triton's copy) are needed) and registers its kernels. ops.py calls
it on import where CUDA is available; ``FASTROPE_REPLAY=0`` keeps the Python kernels. Where the
build fails, the ops keep their Python kernels (the same results, more host time per call) and
:data:`reason` says why.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from importlib import resources

import torch

SOURCE = "replay.cpp"
NAME = "fastrope_replay"  # the library's name, and its directory in the extension cache
ENVIRONMENT = "FASTROPE_REPLAY"

reason: str | None = "not loaded yet"
"""None once replay.cpp's kernels are registered, else why they are not."""

_library: str | None = None  # the built library, once loaded (a second copy would register twice)


def disabled() -> bool:
    """Whether the environment asks for the Python kernels (``FASTROPE_REPLAY=0``)."""
    return os.environ.get(ENVIRONMENT, "1").strip() == "0"


def _cuda_headers() -> list[str]:
    """One directory with the CUDA runtime's headers (c10's CUDA stream includes them): the
    toolkit's where torch finds one, else the copy Triton ships (``triton`` is a dependency)."""
    from torch.utils import cpp_extension

    candidates = []
    if cpp_extension.CUDA_HOME:
        candidates.append(os.path.join(cpp_extension.CUDA_HOME, "include"))
    try:
        import triton

        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                       "include"))
    except ImportError:
        pass
    for directory in candidates:
        if all(os.path.isfile(os.path.join(directory, *name.split("/")))
               for name in ("cuda.h", "cuda_runtime_api.h", "crt/host_defines.h")):
            return [directory]
    raise RuntimeError(f"no CUDA runtime headers (cuda.h, cuda_runtime_api.h, crt/) in "
                       f"{' or '.join(candidates) or 'CUDA_HOME or Triton'}")


def build(verbose: bool = False) -> str:
    """Build replay.cpp (or find it built) and load it into the process; returns the library's
    path. Needs a CUDA build of torch, a C++ compiler, ninja and the CUDA headers; raises where
    one is missing. Once loaded, returns the same library (the process holds one copy)."""
    global _library
    from torch.utils import cpp_extension

    if _library is not None:
        return _library
    if torch.version.cuda is None:
        raise RuntimeError("torch is a build without CUDA")
    source = resources.files("ports.fastrope").joinpath(SOURCE)
    # torch's cache rebuilds for a changed source or build flags, not for another torch with the
    # same paths (an upgrade in place): the name carries torch's version, so each gets its own.
    version = hashlib.sha1(f"{torch.__version__} {torch.version.cuda}".encode()).hexdigest()[:10]
    with resources.as_file(source) as path:  # host code: torch's CPU flags, c10's CUDA library
        _library = cpp_extension.load(
            f"{NAME}_{version}", [str(path)], extra_cflags=["-O2"],
            extra_ldflags=["-ldl", "-lc10_cuda"],
            extra_include_paths=_cuda_headers(), is_python_module=False, verbose=verbose)
    return _library


def load() -> bool:
    """Register replay.cpp's kernels (after ops.py has defined the ops); whether they are. Where
    the build fails, warns once and leaves the Python kernels."""
    global reason
    if reason is None:
        return True
    if disabled():
        reason = f"{ENVIRONMENT}=0"
        return False
    try:
        build()
    except Exception as error:  # noqa: BLE001 - any build failure leaves the Python kernels
        reason = f"replay.cpp was not built: {type(error).__name__}: {error}".splitlines()[0]
        warnings.warn(f"fastrope: {reason}; its ops keep their Python kernels (the same "
                      "results, more host time a call)", RuntimeWarning, stacklevel=2)
        return False
    reason = None
    return True


def loaded() -> bool:
    """Whether replay.cpp's kernels serve the mutating ops on CUDA tensors."""
    return reason is None
