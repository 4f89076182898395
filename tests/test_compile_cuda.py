"""Every .cu source compiles for sm_90 with the options its port uses, without a GPU.

NVRTC (what the ports use at run time) compiles each module's kernels, templates through their
name expressions. Where NVRTC cannot be loaded, ``nvcc --ptx`` compiles the same file with the
same options instead. A .cu file that no port's CudaModule owns fails the test, so no source
escapes it.
"""
from __future__ import annotations

import importlib
import pkgutil
import shutil
import subprocess
from pathlib import Path

import pytest

import ports
from ports import _cupy

ARCH = "sm_90"


def _modules() -> list[_cupy.CudaModule]:
    """Every CudaModule defined in a port family's package or in one of its modules (once each,
    however many modules re-export it)."""
    found: dict[int, _cupy.CudaModule] = {}
    for info in pkgutil.iter_modules(ports.__path__):
        if not info.ispkg or info.name.startswith("_") or info.name == "harness":
            continue
        pkg = importlib.import_module(f"ports.{info.name}")
        names = [pkg.__name__] + [f"{pkg.__name__}.{sub.name}"
                                  for sub in pkgutil.iter_modules(pkg.__path__)]
        for name in names:
            for value in vars(importlib.import_module(name)).values():
                if isinstance(value, _cupy.CudaModule):
                    found[id(value)] = value
    return list(found.values())


MODULES = _modules()


def test_every_cu_file_belongs_to_a_module():
    root = Path(ports.__file__).parent
    sources = {p.relative_to(root).as_posix() for p in root.rglob("*.cu")}
    owned = {f"{m.package.split('.', 1)[1].replace('.', '/')}/{m.filename}" for m in MODULES}
    assert sources, "no .cu sources found"
    assert sources <= owned, f"sources no CudaModule compiles: {sorted(sources - owned)}"


def _nvrtc_works() -> bool:
    try:
        _cupy.compile_source('extern "C" __global__ void k() {}', filename="probe.cu",
                             options=(), name_expressions=(), arch=ARCH, method="ptx")
        return True
    except Exception:
        return False


@pytest.mark.parametrize("module", MODULES, ids=lambda m: f"{m.package}/{m.filename}")
def test_compiles_for_sm90(module):
    if _nvrtc_works():
        templated = [k for k in module.kernels if "<" in k]
        ptx, lowered = _cupy.compile_source(module.source, filename=module.filename,
                                            options=module.options, name_expressions=templated,
                                            arch=ARCH, method="ptx")
        text = ptx.decode() if isinstance(ptx, bytes) else ptx
        for kernel in module.kernels:
            assert f".entry {lowered.get(kernel, kernel)}" in text, f"{kernel} missing from PTX"
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("neither NVRTC (via CuPy) nor nvcc is available to compile CUDA sources")
    path = Path(importlib.import_module(module.package).__file__).parent / module.filename
    cmd = [nvcc, "--ptx", f"-arch={ARCH}", "-std=c++17", *module.options, str(path), "-o", "-"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
