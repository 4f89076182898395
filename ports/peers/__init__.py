"""The production RoPE libraries as rows of the study, registered whether or not they are installed.

A peer is a library a user would deploy instead of writing a kernel: Liger-Kernel, flash-attn's
Triton rotary, FlashInfer, TransformerEngine and vLLM. Nothing here is ported: each spec calls the
installed library through its own public entry point (``canonical.py`` maps the canonical case to
that API). A peer that cannot be imported stays in the registry; its rows say
``not installed: pip install X`` (the runner asks the spec's ``missing()``) and nothing fails.

:class:`PeerSpec` adds two statements to an :class:`~ports._spec.ImplSpec`:

* ``caller_work``: what the peer's API leaves to its caller (e.g. Liger takes cos/sin rows already
  gathered per token; vLLM takes a ``cos_sin_cache`` and per-token positions).
* ``given_less_work``: where the adapter does part of that work outside the timed call, so the
  peer's time covers less than the ports' (every table and summary prints it under the table).
  Empty where the timed call does everything the ports do.

Installing them: ``pip install -e ".[peers]"`` brings liger-kernel (a plain wheel). The others
need more than a wheel: flash-attn builds a CUDA extension (``pip install flash-attn
--no-build-isolation``), but its rotary is plain Triton, so this package loads
``flash_attn/ops/triton/rotary.py`` from the installed package's folder, or from the file named
by ``$ROPE_PORTS_FLASH_ATTN_ROTARY``, without the extension; FlashInfer (``pip install
flashinfer-python``) compiles its kernels at first use (JIT, needs nvcc) and pulls large
dependencies; TransformerEngine (``pip install transformer-engine[pytorch]``) and vLLM (``pip
install vllm``) are large binary wheels pinned to torch and CUDA versions.

User kernels (``compare.py --impl``, entry-point group ``rope_ports.impls``) are built by
:mod:`ports.peers.user` as the same kind of spec.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ports._spec import ImplSpec

# A path to flash-attn's ``flash_attn/ops/triton/rotary.py``: the module is loaded from this file
# when the flash_attn package itself cannot be imported (e.g. a machine without its compiled
# extension, or one that carries only this file).
FLASH_ATTN_ROTARY_ENV = "ROPE_PORTS_FLASH_ATTN_ROTARY"


@dataclass(frozen=True)
class PeerSpec(ImplSpec):
    """An :class:`ImplSpec` that also says what its API leaves to the caller and where the
    adapter moved work out of the timed call (see the module docstring)."""

    caller_work: str = ""
    given_less_work: str = ""
    missing: Callable[[], str | None] | None = None  # why the library cannot run here, or None


class NotInstalled(ImportError):
    """The peer's module cannot be imported; the message says how to get it."""


def import_peer(module: str, install: str) -> ModuleType:
    """``importlib.import_module(module)``, or :class:`NotInstalled` saying
    ``not installed: pip install <install>`` (with the import error's first line)."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # a broken install raises more than ImportError
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:100]
        raise NotInstalled(f"not installed: pip install {install} ({first})") from None


def load_file_module(name: str, path: str | os.PathLike) -> ModuleType:
    """Import the Python file at ``path`` as module ``name`` (once: later calls reuse it)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise NotInstalled(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise
    return module


def flash_attn_rotary() -> ModuleType:
    """flash-attn's ``flash_attn.ops.triton.rotary`` module.

    The package's ``__init__`` imports its compiled CUDA extension; the rotary module itself is
    plain Triton. So: the installed module if the package imports; else the module file from the
    installed package's folder (found without running ``__init__``) or from the path in
    ``$ROPE_PORTS_FLASH_ATTN_ROTARY``; else :class:`NotInstalled` saying which of these failed.
    """
    try:
        return importlib.import_module("flash_attn.ops.triton.rotary")
    except Exception as exc:
        package_error = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:80]
    candidates = []
    if os.environ.get(FLASH_ATTN_ROTARY_ENV):
        candidates.append(Path(os.environ[FLASH_ATTN_ROTARY_ENV]))
    try:
        found = importlib.util.find_spec("flash_attn")
    except Exception:
        found = None
    for folder in (found.submodule_search_locations or []) if found else []:
        candidates.append(Path(folder) / "ops" / "triton" / "rotary.py")
    for path in candidates:
        if path.is_file():
            return load_file_module("_rope_ports_flash_attn_rotary", path)
    raise NotInstalled(f"not installed: pip install flash-attn ({package_error}), or set "
                       f"${FLASH_ATTN_ROTARY_ENV} to its flash_attn/ops/triton/rotary.py")
