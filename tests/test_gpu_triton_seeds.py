"""GPU tests of the Triton seed ports: realistic head dims, recompilation, int64 offsets."""
from __future__ import annotations

import pytest
import torch

from ports import _triton, registry
from ports.harness.runner import run_case
from reference.case import RopeCase, make_inputs
from reference.expected import expected, tolerances
from reference.vocabulary import INT32_MAX

pytestmark = pytest.mark.gpu

TE, BR, KERNL = "triton.te_style", "triton.batch_reuse", "triton.kernl_rbe"
CUDA = frozenset({"cuda"})


def _ok(case, names, seed=0):
    report = run_case(case, registry.select(only=names), seed=seed, timing_on=False,
                      targets=CUDA, device=torch.device("cuda"))
    rows = {r.impl: r for r in report.results}
    for name in names:
        assert rows[name].status == "ok", (name, case.describe(), rows[name].reason)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward(dtype, layout, batch, head_dim):
    case = RopeCase(batch, 257, 12, head_dim, layout=layout, dtype=dtype)
    _ok(case, [TE, BR])
    _ok(case.replace(style="interleaved"), [KERNL])


@pytest.mark.parametrize("grad", ["random", "broadcast"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_backward(grad, dtype, layout):
    case = RopeCase(3, 129, 8, 128, layout=layout, dtype=dtype, direction="backward", grad=grad)
    _ok(case, [TE, BR])
    _ok(case.replace(rotary_dim=64), [TE])


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_strided_and_partial(layout):
    case = RopeCase(2, 100, 6, 128, layout=layout, contiguous=False, dtype="fp16")
    _ok(case, [TE, BR])
    _ok(case.replace(style="interleaved"), [KERNL])
    _ok(case.replace(rotary_dim=32), [TE])


def _te(s, b=2):
    from ports import te_triton
    x = torch.randn(s, b, 4, 64, device="cuda", dtype=torch.float16)
    te_triton.apply_rotary_pos_emb_triton(x, torch.rand(s, 1, 1, 64, device="cuda"))
    return te_triton.rope_kernel


def _br(s, b=2):
    from ports import batch_reuse
    x = torch.randn(s, b, 4, 64, device="cuda", dtype=torch.float16)
    batch_reuse.apply_rotary_pos_emb_triton(x, torch.rand(s, 1, 1, 64, device="cuda"))
    return batch_reuse.rope_batch_reuse_kernel


def _kernl(s, b=2):
    from ports import kernl
    kernl.rbe_triton_wrapper(torch.randn(b, s, 4 * 64, device="cuda", dtype=torch.float16), 0,
                             head_dim=64)
    return kernl.rbe_triton


@pytest.mark.parametrize("call", [_te, _br, _kernl], ids=["te", "batch_reuse", "kernl"])
def test_sequence_length_change_does_not_recompile(call):
    """flash-attn's test_compilation_count: seq_len is dynamic in all three originals.

    Lengths avoid 1 and multiples of 16 (Triton specialises on those) after the first call.
    """
    kernel = call(17)
    before = _triton.compiled_count(kernel)
    assert before >= 1
    for s in (19, 45, 301):
        call(s)
    assert _triton.compiled_count(kernel) == before


def test_batch_size_change_recompiles_batch_reuse():
    """Seed 002's documented cost: BATCH_NUM is a constexpr (static_range over the batch)."""
    kernel = _br(17, b=29)  # batch sizes no other test uses, so the count starts fresh
    before = _triton.compiled_count(kernel)
    _br(17, b=31)
    assert _triton.compiled_count(kernel) == before + 1


def test_kernl_refuses_grids_past_the_y_limit():
    """kernl's 2-D grid puts all (token, channel) tiles on axis 1: past 65535 it is refused."""
    from ports import kernl

    case = RopeCase(1, 16385, 1024, 128, dtype="bf16", style="interleaved")
    assert "grid-y limit" in registry.get(KERNL).unsupported_reason(case)
    x = torch.empty(1, 2 * 65536, 1024, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="grid axis 1"):
        kernl.rbe_triton_wrapper(x, 0, head_dim=128)


@pytest.mark.parametrize("name", [TE, BR])
def test_int64_offsets_past_2_31_elements(name):
    """b*s*h*d just above 2^31 (bf16, ~8.6 GB in + out), where int32 offsets would wrap; check
    the last tokens."""
    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2**30:
        pytest.skip("needs ~24 GiB free GPU memory")
    s, h, d = 16385, 1024, 128  # 2^31 + 2^17 elements
    style = "interleaved" if name == KERNL else "rotate_half"
    case = RopeCase(1, s, h, d, dtype="bf16", style=style)
    assert case.numel > INT32_MAX
    inputs = make_inputs(case, device="cuda")
    out = registry.get(name).prepare(case, inputs)()[0]
    tail = case.replace(seqlen=4)
    x_tail = inputs.x[:, -4:].contiguous()
    tail_inputs = make_inputs(tail, device="cuda")
    tail_inputs.xs = (x_tail,)
    tail_inputs.positions = inputs.positions[:, -4:]
    tail_inputs.angles = inputs.angles
    spec = registry.get(name)
    ref = expected(tail, tail_inputs, spec.table_source)[0]
    (tol,) = tolerances(tail, tail_inputs, (ref,), steps=spec.steps(tail),
                        angle_rel_err=spec.angle_err(tail))
    err = (out[:, -4:].double() - ref).abs()
    assert bool((err <= tol).all()), float((err / tol).max())
    del out, inputs
    torch.cuda.empty_cache()
