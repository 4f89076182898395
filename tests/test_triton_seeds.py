"""The Triton seed ports (000 TE-style, 002 batch-reuse, 004 kernl rbe) against the float64 oracle.

Runs on the CPU under the Triton interpreter (conftest sets TRITON_INTERPRET=1 when there is no
GPU), or on a GPU if there is one; shapes stay tiny because the interpreter is slow. Each case
goes through the harness: outputs NaN-poisoned, inputs checked unchanged, tolerance from the data.
"""
from __future__ import annotations

import pytest
import torch

from ports import registry
from ports.harness import env
from ports.harness.runner import run_case
from reference.case import RopeCase, make_inputs
from reference.expected import expected

TE, BR, KERNL = "triton.te_style", "triton.batch_reuse", "triton.kernl_rbe"
ROTATE_HALF = (TE, BR)

pytestmark = pytest.mark.skipif(
    not ({"cuda", "interpret"} & env.targets()),
    reason="needs a GPU or TRITON_INTERPRET=1 (set by conftest before ports are imported)")


def _ok(case: RopeCase, names, seed: int = 0) -> None:
    report = run_case(case, registry.select(only=names), seed=seed, timing_on=False)
    rows = {r.impl: r for r in report.results}
    for name in names:
        r = rows[name]
        assert r.status == "ok", (name, case.describe(), r.status, r.reason)


# ---- forward, over dtypes, layouts, batch sizes (1 and odd), head dims --------------------------
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("batch", [1, 3])
def test_forward_matches_oracle(dtype, layout, batch):
    base = RopeCase(batch, 5, 2, 16, layout=layout, dtype=dtype)
    _ok(base, ROTATE_HALF)
    _ok(base.replace(style="interleaved"), [KERNL])


@pytest.mark.parametrize("head_dim", [8, 12])  # 12: half = 6, not a power of two (masked block)
def test_head_dims(head_dim):
    case = RopeCase(2, 3, 3, head_dim, layout="sbhd")
    _ok(case, ROTATE_HALF)
    _ok(case.replace(style="interleaved", layout="bshd"), [KERNL])


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_strided_input(layout):
    case = RopeCase(2, 4, 2, 16, layout=layout, contiguous=False)
    _ok(case, ROTATE_HALF)
    _ok(case.replace(style="interleaved"), [KERNL])


def test_q_and_k_with_different_head_counts():
    case = RopeCase(2, 4, 3, 16, kv_heads=1)
    _ok(case, ROTATE_HALF)
    _ok(case.replace(style="interleaved"), [KERNL])


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_partial_rotary_te_only(layout):
    case = RopeCase(3, 4, 2, 16, layout=layout, rotary_dim=8, dtype="bf16")
    _ok(case, [TE])
    reason = registry.get(BR).unsupported_reason(case, {"interpret", "cuda"})
    assert reason and "partial" in reason


# ---- backward: random and zero-stride (broadcast) gradients ---------------------------------
@pytest.mark.parametrize("grad", ["random", "broadcast"])
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_backward(grad, layout):
    case = RopeCase(3, 4, 2, 16, layout=layout, direction="backward", grad=grad, dtype="fp16")
    _ok(case, ROTATE_HALF)
    _ok(case.replace(rotary_dim=8, dtype="fp32"), [TE])  # the tail's gradient passes through
    assert "no backward" in registry.get(KERNL).unsupported_reason(
        case.replace(style="interleaved"), {"interpret", "cuda"})


def test_autograd_end_to_end():
    """Through torch.autograd: out.sum()*2 hands back a zero-stride gradient."""
    from ports import batch_reuse, te_triton
    from ports.te_triton.canonical import te_freqs

    case = RopeCase(2, 4, 2, 8, layout="sbhd")
    inputs = make_inputs(case, device=env.device())
    freqs = te_freqs(inputs)
    for mod in (te_triton, batch_reuse):
        x = inputs.x.clone().requires_grad_(True)
        (mod.apply_rotary_pos_emb_triton(x, freqs, "sbhd").sum() * 2).backward()
        twos = torch.full_like(inputs.x, 2.0)
        ref = expected(case.replace(direction="backward"),
                       _with_grads(inputs, (twos,)), source="angles32")[0]
        torch.testing.assert_close(x.grad.double(), ref, rtol=0, atol=1e-6)


def _with_grads(inputs, grads):
    import dataclasses
    return dataclasses.replace(inputs, grads=grads)


# ---- kernl specifics -------------------------------------------------------------------------
@pytest.mark.parametrize("pos,bm,bk", [(0, 2, 1024), (5, 4, 16), (3, 1, 8)])
def test_kernl_start_position_and_tiles(pos, bm, bk):
    """Tiles smaller than K and partial M tiles; positions start at ``pos``."""
    from ports.kernl import rbe_triton_wrapper

    b, s, h, d = 2, 7, 3, 16
    case = RopeCase(b, s, h, d, style="interleaved", positions="offset",
                    max_position=pos + s + s)  # only to get a long enough angle table
    inputs = make_inputs(case, device=env.device())
    inputs.positions = (pos + torch.arange(s, device=env.device())).expand(b, s)
    y = rbe_triton_wrapper(inputs.x.view(b, s, h * d), pos, head_dim=d, block_size_m=bm,
                           block_size_k=bk)
    ref = expected(case, inputs, source="computed")[0]
    torch.testing.assert_close(y.view(b, s, h, d).double(), ref, rtol=0, atol=2e-6)


# ---- bad inputs raise before any launch -----------------------------------------------------
def test_bad_inputs_te_and_batch_reuse():
    from ports import batch_reuse, te_triton

    dev = env.device()
    t = torch.randn(4, 2, 3, 8, device=dev)
    freqs = torch.zeros(4, 1, 1, 8, device=dev)
    for mod in (te_triton, batch_reuse):
        f = mod.apply_rotary_pos_emb_triton
        with pytest.raises(TypeError):
            f(t.double(), freqs)
        with pytest.raises(TypeError):
            f(t, freqs.half())
        with pytest.raises(ValueError):
            f(t, freqs, "thd")
        with pytest.raises(ValueError):
            f(t[0], freqs)
        with pytest.raises(ValueError):
            f(t, freqs[:3])  # fewer positions than tokens
    with pytest.raises(ValueError):
        te_triton.apply_rotary_pos_emb_triton(t, torch.zeros(4, 1, 1, 10, device=dev))  # d2 > d
    with pytest.raises(NotImplementedError, match="rotary_percent"):
        batch_reuse.apply_rotary_pos_emb_triton(t, freqs[..., :4])


def test_bad_inputs_kernl():
    from ports.kernl import rbe_triton_wrapper

    x = torch.randn(2, 3, 32, device=env.device())
    with pytest.raises(TypeError):
        rbe_triton_wrapper(x.to(torch.int32), 0, head_dim=16)
    with pytest.raises(ValueError):
        rbe_triton_wrapper(x[0], 0, head_dim=16)
    with pytest.raises(ValueError):
        rbe_triton_wrapper(x, 0, head_dim=12)  # 32 % 12
    with pytest.raises(ValueError):
        rbe_triton_wrapper(x, -1, head_dim=16)
    with pytest.raises(ValueError):
        rbe_triton_wrapper(x, 0, head_dim=16, block_size_k=24)
    with pytest.raises(ValueError):
        rbe_triton_wrapper(x, 0, head_dim=16, out=torch.empty(2, 3, 16, device=x.device))


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    from ports.te_triton import apply_rotary_pos_emb_triton

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        apply_rotary_pos_emb_triton(torch.randn(2, 1, 1, 4), torch.zeros(2, 1, 1, 4))


def test_outputs_are_fresh_and_inputs_untouched():
    from ports.te_triton import apply_rotary_pos_emb_triton

    t = torch.randn(3, 1, 2, 8, device=env.device())
    keep = t.clone()
    freqs = torch.rand(3, 1, 1, 8, device=t.device)
    y = apply_rotary_pos_emb_triton(t, freqs)
    assert y.data_ptr() != t.data_ptr()
    assert torch.equal(t, keep)
