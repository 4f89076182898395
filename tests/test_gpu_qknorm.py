"""qk_norm_rope on the GPU: mid-size shapes against the float64 oracle (run on the GPU in
float64), one case past 64 MB, the custom ops under opcheck, torch.compile(fullgraph=True) with
inductor (the op alone bitwise equal to eager forward and backward; a small attention module
within fp32 rounding; one compile across sequence lengths),
CUDA-graph capture, and the weight gradients bitwise equal from run to run.

The checks are tests/test_qknorm.py's (:func:`check_forward`, :func:`check_backward`),
which NaN-poison the outputs and check the inputs unchanged.
"""
from __future__ import annotations

import math

import pytest
import torch

from ports.fastrope import qknorm
from ports.fastrope.qknorm import qk_norm_rope
from reference.qk_norm import (backward_tolerances, forward_tolerance, qk_norm_rope_oracle,
                               qk_norm_rope_oracle_backward, rms_norm)
from reference.tables import rope_tables
from test_qknorm import EPS, Case, _close, _op_args, check_backward, check_forward, make_case

pytestmark = pytest.mark.gpu

MID = dict(b=2, s=257, hq=16, hk=4, d=128)  # 514 tokens: the backward's 8-token programs


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
def test_forward_mid(dtype, style):
    check_forward(Case(**MID, dtype=dtype, style=style))
    check_forward(Case(**MID, dtype=dtype, style=style, asymmetric=True, positions="ids"))


@pytest.mark.parametrize("case", [
    Case(**MID, layout="sbhd", dtype="bf16"),
    Case(**MID, layout="bhsd", dtype="fp16", source="half"),
    Case(**MID, layout="thd", positions="ids", dtype="bf16"),
    Case(**dict(MID, d=256), gemma=True, dtype="bf16", weight_dtype="fp32"),  # Gemma3's head
    Case(**MID, rot=64, dtype="bf16", source="computed", positions="ids", base=1e6),
    Case(**dict(MID, d=96, hk=1), rot=48, style="interleaved", dtype="fp16"),
], ids=["sbhd", "bhsd-half", "thd", "gemma-256", "partial-computed", "mqa-d96-partial"])
def test_forward_cases(case):
    check_forward(case)
    check_forward(case, in_place=True)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
def test_backward_mid(dtype, style):
    check_backward(Case(**MID, dtype=dtype, style=style, asymmetric=True))


@pytest.mark.parametrize("case", [
    Case(**MID, layout="sbhd", dtype="bf16", rot=64, asymmetric=True),
    Case(**MID, layout="thd", positions="ids", dtype="bf16", gemma=True, weight_dtype="fp32"),
    Case(**dict(MID, d=256), gemma=True, dtype="bf16", source="computed"),
    Case(b=1, s=3, hq=8, hk=2, d=128, dtype="bf16"),  # a decode-sized step: 1 token a program
], ids=["partial-sbhd", "thd-gemma", "gemma-256-computed", "tiny"])
def test_backward_cases(case):
    check_backward(case)
    check_backward(case, broadcast_grad=True)


def test_large_case_over_64_mb():
    """bf16 q [1, 8192, 32, 128] (64 MiB) and k [.., 8, ..]: forward and backward vs the
    oracle."""
    c = Case(b=1, s=8192, hq=32, hk=8, d=128, dtype="bf16", positions="ids")
    check_forward(c)
    check_backward(c)


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["head", "token"])
def test_more_than_2_31_elements(norm):
    """q [1, 524289, 32, 128] bf16, 2^31 + 4096 elements (k: 8 heads), per-token positions: the
    forward's and the backward's offsets past element 2^31 must be 64-bit. q's and k's outputs
    and gradients on their first and last 64 tokens (the last lie past element 2^31 of q)
    against the oracle of those tokens alone; the weight gradients against the oracle summed
    over chunks of tokens."""
    if torch.cuda.get_device_properties(0).total_memory < 60e9:
        pytest.skip("needs a GPU with 60 GB or more (about 35 GB at the peak)")
    hq, hk, d, rows = 32, 8, 128, 4096
    s = 2**31 // (hq * d) + 1
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, shift=0.25):  # fresh values, never zeros
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16() + shift

    q, k = rand(1, s, hq, d), rand(1, s, hk, d)
    assert q.numel() > 2**31
    widths = (hq * d, hk * d) if norm == "token" else (d, d)
    qw, kw = (rand(n, shift=1.0) for n in widths)
    cos, sin = rope_tables(rows, d, device="cuda")
    pos = torch.randint(0, rows, (1, s), device="cuda", generator=gen)
    leaves = [t.requires_grad_(True) for t in (q, k, qw, kw)]
    qo, ko = qk_norm_rope(*leaves, EPS, cos=cos, sin=sin, positions=pos.int(),
                          **({"norm": norm} if norm != "head" else {}))
    grads = rand(1, s, hq, d, shift=0.0), rand(1, s, hk, d, shift=0.0)
    dq, dk, dqw, dkw = torch.autograd.grad((qo, ko), leaves, grads)
    okw = dict(cos_table=cos.double(), sin_table=sin.double(), layout="bshd",
               style="rotate_half", norm=norm)
    for name, x, w, out, g, dx, dw in (("q", q, qw, qo, grads[0], dq, dqw),
                                       ("k", k, kw, ko, grads[1], dk, dkw)):
        x, w, out = x.detach(), w.detach(), out.detach()
        width = d * x.shape[2] if norm == "token" else d
        for t0 in (0, s - 64):
            xs, gs, ps = x[:, t0:t0 + 64], g[:, t0:t0 + 64], pos[:, t0:t0 + 64]
            ref = qk_norm_rope_oracle(xs, w, EPS, positions=ps, **okw)
            z = rms_norm(xs, w, EPS, norm=norm)
            _close(out[:, t0:t0 + 64], ref, forward_tolerance(ref, z, x.dtype, width),
                   f"{name}_out, tokens {t0}..")
            dx_ref, _ = qk_norm_rope_oracle_backward(xs, w, gs, EPS, positions=ps, **okw)
            dx_tol, _ = backward_tolerances(xs, w, gs, EPS, positions=ps, **okw,
                                            dx_dtype=x.dtype, dw_dtype=w.dtype)
            _close(dx[:, t0:t0 + 64], dx_ref, dx_tol, f"d{name}, tokens {t0}..")
        # dw sums over every token: the oracle's, chunk by chunk; each chunk's tolerance widened
        # from its own count of summed terms to the whole sum's (the bound grows with log2 N)
        per_token = 1 if norm == "token" else x.shape[2]
        dw_ref = dw_tol = 0.0
        for t0 in range(0, s, 32768):
            xs, gs, ps = x[:, t0:t0 + 32768], g[:, t0:t0 + 32768], pos[:, t0:t0 + 32768]
            dw_ref = dw_ref + qk_norm_rope_oracle_backward(xs, w, gs, EPS, positions=ps,
                                                           **okw)[1]
            _, tol = backward_tolerances(xs, w, gs, EPS, positions=ps, **okw, dx_dtype=x.dtype,
                                         dw_dtype=w.dtype)
            terms = xs.shape[1] * per_token
            dw_tol = dw_tol + tol * ((math.log2(s * per_token) + 8)
                                     / (math.log2(max(terms, 2)) + 8))
        _close(dw, dw_ref, dw_tol, f"d{name}_weight")


@pytest.mark.parametrize("case", [
    Case(b=2, s=257, hq=32, hk=32, d=128, dtype="bf16", norm="token"),  # OLMo2-7B's attention
    Case(**MID, dtype="fp32", style="interleaved", asymmetric=True, norm="token"),
    Case(**MID, dtype="fp16", layout="sbhd", rot=64, positions="ids", norm="token"),
    Case(b=4, s=300, hq=16, hk=4, d=128, dtype="bf16", weight_dtype="fp32", asymmetric=True,
         norm="token"),  # 1200 tokens: 16 a backward program
], ids=["olmo2-7b", "fp32-interleaved", "fp16-sbhd-partial-ids", "long-run"])
def test_token_norm(case):
    """norm="token" (OLMo2: over all heads of a token) forward, in place and backward."""
    check_forward(case)
    check_forward(case, in_place=True)
    first, second = check_backward(case), check_backward(case)
    for name in ("dqw", "dkw"):
        assert torch.equal(first[name], second[name]), name


def test_weight_gradients_bitwise_deterministic():
    c = Case(**MID, dtype="bf16", weight_dtype="fp32")
    first, second = check_backward(c), check_backward(c)
    for name in ("dq", "dk", "dqw", "dkw"):
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("case", [
    Case(b=2, s=9, hq=4, hk=2, d=64),
    Case(b=2, s=9, hq=4, hk=2, d=64, rot=32, style="interleaved", source="half",
         positions="ids", gemma=True, layout="sbhd", dtype="bf16"),
    Case(b=2, s=9, hq=4, hk=1, d=64, source="computed", dtype="fp16", weight_dtype="fp32",
         layout="bhsd"),
], ids=["tables", "partial-half-ids-gemma", "computed-fp16"])
def test_opcheck_cuda(case):
    args = _op_args(case)
    q, k, qw, kw = (t.detach().clone().requires_grad_(True) for t in args[:4])
    torch.library.opcheck(torch.ops.fastrope.qk_norm_rope.default, (q, k, qw, kw, *args[4:]))
    g = [torch.randn_like(q), torch.randn_like(k)]
    torch.library.opcheck(torch.ops.fastrope.qk_norm_rope_backward.default,
                          (*g, *(t.detach() for t in (q, k, qw, kw)), *args[4:-1]))
    torch.library.opcheck(torch.ops.fastrope.qk_norm_rope_.default,
                          (args[0].clone(), args[1].clone(), *args[2:]))


class _QKNormRoPE(torch.nn.Module):
    """Projection, fused q/k norm + RoPE, attention: what a Qwen3 layer does around the op."""

    def __init__(self, hidden=256, hq=4, hk=2, d=64):
        super().__init__()
        self.hq, self.hk, self.d = hq, hk, d
        self.q_proj = torch.nn.Linear(hidden, hq * d, bias=False)
        self.k_proj = torch.nn.Linear(hidden, hk * d, bias=False)
        self.q_norm = torch.nn.Parameter(torch.randn(d) * 0.1 + 1)
        self.k_norm = torch.nn.Parameter(torch.randn(d) * 0.1 + 1)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.hq, self.d)
        k = self.k_proj(x).view(b, s, self.hk, self.d)
        q, k = qk_norm_rope(q, k, self.q_norm, self.k_norm, EPS, cos=cos, sin=sin)
        k = k.repeat_interleave(self.hq // self.hk, dim=2)
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), is_causal=True)


def _counting_inductor(compiles: set):
    """Inductor, adding each compile's id to ``compiles``. An id, not a call: dynamo may restart
    a compile's analysis (a Python float such as eps that inductor cannot turn into a tensor is
    then specialised), and the restart calls the backend again under the same id; whether it
    restarts depends on what the process compiled before, so counting calls failed the module
    test run alone and passed it in the full suite."""
    from torch._guards import CompileContext
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        compiles.add(str(CompileContext.current_compile_id()))
        return compile_fx(gm, example_inputs)

    return backend


def test_torch_compile_fullgraph_op_bitwise():
    """The op alone under inductor: forward and all four gradients bitwise equal to eager; no
    compile for a third sequence length (the second may recompile once: dynamo can specialise
    the first call's sizes even under dynamic=True)."""
    compiles = set()
    kw = dict(style="interleaved", rotary_dim=32, gemma=True)

    def step(q, k, qw, kw_, cos, sin):
        return qk_norm_rope(q, k, qw, kw_, EPS, cos=cos, sin=sin, **kw)

    compiled = torch.compile(step, fullgraph=True, dynamic=True,
                             backend=_counting_inductor(compiles))
    for s in (17, 33, 65):
        if s == 65:
            before = len(compiles)
        inp = make_case(Case(b=2, s=s, hq=4, hk=2, d=64, rot=32, style="interleaved",
                             gemma=True, dtype="bf16", asymmetric=True))
        args = [inp[n] for n in ("q", "k", "qw", "kw")]
        tabs = (inp["kwargs"]["cos"], inp["kwargs"]["sin"])
        lc = [a.detach().clone().requires_grad_(True) for a in args]
        le = [a.detach().clone().requires_grad_(True) for a in args]
        out_c, out_e = compiled(*lc, *tabs), step(*le, *tabs)
        gs = [torch.randn_like(o) for o in out_e]
        for a, b in zip(out_c, out_e):
            assert torch.equal(a, b)
        for a, b in zip(torch.autograd.grad(out_c, lc, gs), torch.autograd.grad(out_e, le, gs)):
            assert torch.equal(a, b)
    assert len(compiles) == before <= 2, f"{len(compiles)} compiles for three sequence lengths"


def test_torch_compile_fullgraph_module():
    """A projection, the fused op and attention compiled whole: no graph break, one compile
    across sequence lengths; outputs and parameter gradients equal to eager within fp32
    rounding (inductor may reorder the sums around the op)."""
    from reference.tables import rope_tables

    compiles = set()
    torch.manual_seed(0)
    module = _QKNormRoPE().cuda()
    eager = _QKNormRoPE().cuda()
    eager.load_state_dict(module.state_dict())
    compiled = torch.compile(module, fullgraph=True, dynamic=True,
                             backend=_counting_inductor(compiles))
    cos, sin = rope_tables(64, 64, device="cuda")
    for s in (17, 33):
        x = torch.randn(2, s, 256, device="cuda")
        out_c, out_e = compiled(x, cos, sin), eager(x, cos, sin)
        torch.testing.assert_close(out_c, out_e)
        g = torch.randn_like(out_c)
        out_c.backward(g)
        out_e.backward(g)
        for (name, pc), pe in zip(module.named_parameters(), eager.parameters()):
            torch.testing.assert_close(pc.grad, pe.grad, msg=name)
            pc.grad, pe.grad = None, None
    assert len(compiles) == 1, f"{len(compiles)} compiles for two sequence lengths"


def test_cuda_graph_capture_and_replay():
    """Captured with ids (the position check is skipped during the capture), replayed with new
    inputs: equal to eager calls."""
    c = Case(**MID, dtype="bf16", positions="ids")
    inp = make_case(c)
    kw = inp["kwargs"]
    q, k = inp["q"].clone(), inp["k"].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        qk_norm_rope(q, k, inp["qw"], inp["kw"], EPS, **kw)  # warm up (compile) off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qo, ko = qk_norm_rope(q, k, inp["qw"], inp["kw"], EPS, **kw)
    other = make_case(c, seed=5)
    q.copy_(other["q"])
    k.copy_(other["k"])
    kw["positions"].copy_(other["kwargs"]["positions"])
    graph.replay()
    want_q, want_k = qk_norm_rope(other["q"], other["k"], inp["qw"], inp["kw"], EPS, **kw)
    assert torch.equal(qo, want_q) and torch.equal(ko, want_k)


def test_cuda_graph_capture_backward():
    """A forward + backward step captured in one graph (the weight-gradient reduction launched
    as the backward's programmatic dependent, sm_90 and up), replayed with new inputs and
    gradients: equal to eager steps."""
    c = Case(**MID, dtype="bf16", asymmetric=True)
    inp, other = make_case(c), make_case(c, seed=5)
    kw = inp["kwargs"]
    leaves = [inp[n].detach().clone().requires_grad_(True) for n in ("q", "k", "qw", "kw")]
    grads = [torch.randn_like(leaves[0]), torch.randn_like(leaves[1])]

    def step():
        return torch.autograd.grad(qk_norm_rope(*leaves, EPS, **kw), leaves, grads)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up (compile) off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    with torch.no_grad():
        for leaf, name in zip(leaves, ("q", "k", "qw", "kw")):
            leaf.copy_(other[name])
    for g in grads:
        g.copy_(torch.randn_like(g))
    graph.replay()
    want = step()
    for name, a, b in zip(("dq", "dk", "dqw", "dkw"), got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("norm,style", [("head", "rotate_half"), ("token", "interleaved")])
def test_weight_gradient_reduction_by_dependent_launch(monkeypatch, norm, style):
    """On sm_90 and up the reduction follows the backward by programmatic dependent launch; it
    waits for the backward's partial rows (which the poisoned allocator starts as NaN): the
    gradients are the oracle's, and bitwise those of the plain launch. Qwen3-8B's heads at 4k
    tokens, where the backward runs about 50 us while the reduction is resident (OLMo2's norm
    interleaved: plain loads, where it launches so; through TMA it does not)."""
    device = torch.device("cuda", torch.cuda.current_device())
    assert qknorm._pdl(device) == (torch.cuda.get_device_capability(device)[0] >= 9)
    c = Case(b=1, s=4096, hq=32, hk=8, d=128, dtype="bf16", norm=norm, style=style)
    dependent = check_backward(c)
    monkeypatch.setattr(qknorm, "WEIGHT_GRAD_PDL", False)
    plain = check_backward(c)
    for name in ("dq", "dk", "dqw", "dkw"):
        assert torch.equal(dependent[name], plain[name]), name


def test_second_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    check_forward(Case(b=1, s=9, hq=4, hk=2, d=64, device="cuda:1"))
    check_backward(Case(b=1, s=9, hq=4, hk=2, d=64, device="cuda:1", asymmetric=True))
