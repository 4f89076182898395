"""Every error path of the torch -> CuPy adapter and of the LeetCUDA port's host checks.

The checks run before any launch, so they are exercised here without a GPU: the device check
comes last, after every shape, dtype, size and alignment check.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ports import _alloc, _cupy, leetcuda

KERNELS = [leetcuda.rope_f32, leetcuda.rope_f32_v2, leetcuda.rope_f32x4_pack]
ids = [k.__name__ for k in KERNELS]


def _pair(shape=(8, 16), dtype=torch.float32):
    x = torch.randn(shape, dtype=torch.float32).to(dtype)
    return x, torch.empty_like(x)


@pytest.mark.parametrize("kernel", KERNELS, ids=ids)
def test_cpu_tensor_is_refused(kernel):
    x, out = _pair()
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        kernel(x, out)


@pytest.mark.parametrize("kernel", KERNELS, ids=ids)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_unsupported_dtype(kernel, dtype):
    x, out = _pair(dtype=dtype)
    with pytest.raises(TypeError, match="this port supports float32"):
        kernel(x, out)


@pytest.mark.parametrize("kernel", KERNELS, ids=ids)
def test_wrong_rank(kernel):
    x, out = _pair((2, 8, 16))
    with pytest.raises(ValueError, match=r"must be 2-D \[seq_len, hidden\]"):
        kernel(x, out)


@pytest.mark.parametrize("kernel", KERNELS, ids=ids)
def test_odd_head_dim(kernel):
    x, out = _pair((8, 6 if kernel is leetcuda.rope_f32x4_pack else 7))
    with pytest.raises(ValueError, match="must be a multiple of"):
        kernel(x, out)


@pytest.mark.parametrize("kernel", KERNELS, ids=ids)
def test_non_contiguous_and_mismatched(kernel):
    x, out = _pair((16, 8))
    with pytest.raises(ValueError, match="must be contiguous"):
        kernel(x.t(), out.t())
    with pytest.raises(ValueError, match="out has shape"):
        kernel(x, torch.empty(16, 4))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        leetcuda.rope_f32(np.zeros((4, 4), np.float32), torch.empty(4, 4))


def test_misaligned_pointer_for_float4():
    base = torch.randn(8 * 16 + 1)
    x = base[1:].view(8, 16)  # 4-byte offset: contiguous but not 16-byte aligned
    with pytest.raises(ValueError, match="16-byte aligned"):
        leetcuda.rope_f32x4_pack(x, torch.empty(8, 16))


def test_v2_block_limit():
    x, out = _pair((2, 4096))
    with pytest.raises(ValueError, match="threads per block"):
        leetcuda.rope_f32_v2(x, out)


@pytest.mark.parametrize("kernel", KERNELS, ids=ids)
def test_int32_overflow_is_refused(kernel):
    # 2^31 float32 elements: torch.empty reserves 8 GiB of address space without touching it,
    # and the check raises before anything reads the memory.
    hidden = 2048 if kernel is leetcuda.rope_f32_v2 else 1024
    x = torch.empty(2**31 // hidden, hidden)
    with pytest.raises(NotImplementedError, match="32-bit ints"):
        kernel(x, x)


def test_scalar_helpers():
    assert isinstance(_cupy.i32(5), np.int32) and isinstance(_cupy.i64(5), np.int64)
    assert isinstance(_cupy.f32(0.5), np.float32)
    with pytest.raises(OverflowError):
        _cupy.i32(2**31)
    assert _cupy.ptr(None) == 0


def test_max_offset_of_strided_views():
    t = torch.empty(4, 6, 8)[:, :2]
    assert _cupy.max_offset(t) == 3 * 48 + 1 * 8 + 7
    assert _cupy.max_offset(torch.empty(0, 3)) == 0


def test_devices_must_match():
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="y must be a CUDA tensor"):
            _cupy.check_cuda(("x", torch.empty(1, device="cuda")), ("y", torch.empty(1)))
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        _cupy.check_cuda(("x", torch.empty(1)))


def test_missing_cupy_is_a_clear_runtime_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy":
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(_cupy, "_cupy_module", None)
    monkeypatch.setattr(_cupy, "_cupy_import_error", None)
    monkeypatch.setattr(builtins, "__import__", no_cupy)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[cuda13\]'") as exc:
        _cupy.cupy()
    assert isinstance(exc.value.__cause__, ImportError)


def test_empty_grid_is_refused_before_launch():
    with pytest.raises(ValueError, match="empty grid"):
        _cupy.launch(leetcuda.MODULE, "rope_f32_kernel", 0, (0,), (256,), ())


def test_poisoned_allocation():
    with _alloc.poisoned():
        t = _alloc.empty((3,), dtype=torch.float32, device="cpu")
        i = _alloc.empty((3,), dtype=torch.int32, device="cpu")
    assert torch.isnan(t).all() and (i == -1).all()
    assert _alloc._poison_depth == 0


def test_kernel_source_is_package_data():
    assert "rope_f32x4_pack_kernel" in leetcuda.MODULE.source
