"""qk_norm_rope (fused per-head RMSNorm then RoPE) against the float64 oracle, without a GPU.

The Triton kernels run on CPU tensors under the interpreter (conftest sets TRITON_INTERPRET=1
before any port is imported), so the shapes stay small. Every check compares with
:func:`reference.qk_norm.qk_norm_rope_oracle` (or its autograd backward) with tolerances from
the data (:mod:`reference.qk_norm`), on fresh random inputs with fixed seeds, outputs NaN-poisoned
and inputs checked unchanged. The GPU suite (tests/test_gpu_qknorm.py) reuses
:func:`make_case`, :func:`check_forward` and :func:`check_backward` at mid sizes.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import pytest
import torch

from ports import _alloc, _triton
from ports.fastrope import qknorm as qknr
from ports.fastrope.qknorm import qk_norm_rope, qk_norm_rope_inplace
from reference import tables
from reference.layouts import shape_of
from reference.qk_norm import (backward_tolerances, forward_tolerance, qk_norm_rope_oracle,
                               qk_norm_rope_oracle_backward, rms_norm)
from reference.vocabulary import DTYPES

EPS = 1e-6

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or _triton.interpreting()),
    reason="needs a GPU or TRITON_INTERPRET=1 (set by conftest before ports are imported)")


# ---- cases -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One call: sizes, conventions, where the angles come from and how positions are given."""

    b: int = 2
    s: int = 5
    hq: int = 4
    hk: int = 2
    d: int = 16
    rot: int | None = None
    layout: str = "bshd"
    style: str = "rotate_half"
    dtype: str = "fp32"
    weight_dtype: str | None = None  # None: the same as q
    source: str = "tables"           # tables ([L, R]), half ([L, R/2]), computed (from base)
    positions: str = "arange"        # arange (None), ids ([b, s] or thd [t])
    asymmetric: bool = False         # [L, R] tables whose pair members differ (backward checks)
    gemma: bool = False
    base: float = 10000.0
    norm: str = "head"               # head ([d] weights) or token (OLMo2: [heads * d] weights)
    device: str = field(default="cuda" if torch.cuda.is_available() else "cpu")

    @property
    def rotary_dim(self) -> int:
        return self.rot or self.d


def make_case(c: Case, seed: int = 0) -> dict:
    """Inputs (on ``c.device``) and the oracle's view of them (float64 full-width tables and
    per-token positions, on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[c.dtype]
    wdt = DTYPES[c.weight_dtype or c.dtype]
    rot, rows = c.rotary_dim, c.s + 3

    def rand(*shape):  # fresh values, never zeros
        return torch.randn(*shape, generator=gen) + 0.25

    q = rand(*shape_of(c.layout, c.b, c.s, c.hq, c.d)).to(dt)
    k = rand(*shape_of(c.layout, c.b, c.s, c.hk, c.d)).to(dt)
    nq, nk = (c.hq * c.d, c.hk * c.d) if c.norm == "token" else (c.d, c.d)
    qw = (0.5 * torch.randn(nq, generator=gen) + (0.0 if c.gemma else 1.0)).to(wdt)
    kw = (0.5 * torch.randn(nk, generator=gen) + (0.0 if c.gemma else 1.0)).to(wdt)
    ang = tables.angles(torch.arange(rows), tables.inv_freq(rot, c.base))
    cos64, sin64 = tables.cos_sin(ang, c.style, torch.float64)
    if c.asymmetric:  # members of a pair get different values: a wrong transpose shows
        cos64 = torch.rand(rows, rot, generator=gen, dtype=torch.float64) * 2 - 1
        sin64 = torch.rand(rows, rot, generator=gen, dtype=torch.float64) * 2 - 1
    kw_tables = {}
    if c.source != "computed":
        cos32, sin32 = cos64.float(), sin64.float()
        cos64, sin64 = cos32.double(), sin32.double()  # the oracle uses what the kernel reads
        if c.source == "half":
            cos32 = tables.first_members(cos32, c.style).contiguous()
            sin32 = tables.first_members(sin32, c.style).contiguous()
        kw_tables = dict(cos=cos32.to(c.device), sin=sin32.to(c.device))
    tokens = c.b * c.s
    if c.positions == "ids":
        ids = torch.randint(0, rows, (tokens,) if c.layout == "thd" else (c.b, c.s),
                            generator=gen)
        oracle_pos = ids
        kw_tables["positions"] = ids.to(torch.int32).to(c.device)
    else:
        oracle_pos = torch.arange(c.s).expand(c.b, c.s)
    call = dict(style=c.style, layout=c.layout, rotary_dim=c.rot, base=c.base, gemma=c.gemma,
                **({"norm": c.norm} if c.norm != "head" else {}),
                **kw_tables)
    return dict(q=q.to(c.device), k=k.to(c.device), qw=qw.to(c.device), kw=kw.to(c.device),
                kwargs=call, cos64=cos64, sin64=sin64, pos=oracle_pos)


def _oracle_kw(c: Case, inp: dict) -> dict:
    """The oracle's arguments, on the case's device (float64 runs on the GPU there)."""
    return dict(cos_table=inp["cos64"].to(c.device), sin_table=inp["sin64"].to(c.device),
                positions=inp["pos"].to(c.device), layout=c.layout, style=c.style,
                gemma=c.gemma, norm=c.norm)


def _close(actual: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    """``|actual - ref| <= tol`` elementwise (``tol`` 0-d or broadcastable), with a report."""
    actual = actual.detach().double()
    assert not actual.isnan().any(), f"{what}: NaN (an element left unwritten?)"
    err = (actual - ref.to(actual.device)).abs()
    bad = err > tol.to(actual.device)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {err.numel()} elements beyond "
                           f"tolerance; max err {float(err.max()):.3e}, tol "
                           f"{float(tol.max()):.3e}")


def check_forward(c: Case, seed: int = 0, *, in_place: bool = False) -> None:
    inp = make_case(c, seed)
    q0, k0 = inp["q"].clone(), inp["k"].clone()
    with _alloc.poisoned():
        if in_place:
            qo, ko = qk_norm_rope_inplace(inp["q"], inp["k"], inp["qw"], inp["kw"], EPS,
                                          **inp["kwargs"])
            assert qo is inp["q"] and ko is inp["k"]
        else:
            qo, ko = qk_norm_rope(inp["q"], inp["k"], inp["qw"], inp["kw"], EPS, **inp["kwargs"])
            assert torch.equal(inp["q"], q0) and torch.equal(inp["k"], k0), "inputs changed"
            assert qo.is_contiguous() and ko.is_contiguous()
    for name, out, x, w, h in (("q", qo, q0, inp["qw"], c.hq), ("k", ko, k0, inp["kw"], c.hk)):
        assert out.shape == x.shape and out.dtype == x.dtype
        ref = qk_norm_rope_oracle(x, w, EPS, **_oracle_kw(c, inp))
        z = rms_norm(x, w, EPS, gemma=c.gemma, norm=c.norm, layout=c.layout)
        width = c.d * h if c.norm == "token" else c.d  # the channels one norm sums
        _close(out, ref, forward_tolerance(ref, z, x.dtype, width), f"{name}_out {c}")


def check_backward(c: Case, seed: int = 0, *, broadcast_grad: bool = False) -> dict:
    """dq, dk, dq_weight, dk_weight against the oracle; returns them."""
    inp = make_case(c, seed)
    leaves = [inp[n].detach().clone().requires_grad_(True) for n in ("q", "k", "qw", "kw")]
    with _alloc.poisoned():
        qo, ko = qk_norm_rope(*leaves, EPS, **inp["kwargs"])
    gen = torch.Generator().manual_seed(seed + 1)
    if broadcast_grad:  # zero-stride gradients, as from out.sum()
        grads = [torch.ones((), dtype=o.dtype, device=o.device).expand(o.shape) for o in (qo, ko)]
    else:
        grads = [torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device) for o in (qo, ko)]
    with _alloc.poisoned():
        dq, dk, dqw, dkw = torch.autograd.grad((qo, ko), leaves, grads)
    got = dict(dq=dq, dk=dk, dqw=dqw, dkw=dkw)
    for x, w, g, dx, dw, name in ((inp["q"], inp["qw"], grads[0], dq, dqw, "q"),
                                  (inp["k"], inp["kw"], grads[1], dk, dkw, "k")):
        okw = _oracle_kw(c, inp)
        dx_ref, dw_ref = qk_norm_rope_oracle_backward(x, w, g, EPS, **okw)
        dx_tol, dw_tol = backward_tolerances(x, w, g, EPS, **okw, dx_dtype=x.dtype,
                                             dw_dtype=w.dtype)
        assert dx.dtype == x.dtype and dw.dtype == w.dtype and dw.shape == w.shape
        _close(dx, dx_ref, dx_tol, f"d{name} {c}")
        _close(dw, dw_ref, dw_tol, f"d{name}_weight {c}")
    return got


# ---- forward -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
def test_forward_dtypes_styles(dtype, style):
    check_forward(Case(dtype=dtype, style=style))


@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
def test_forward_asymmetric_tables(style):
    """Each pair member reads its own cos/sin (a kernel reading one value per pair fails)."""
    check_forward(Case(style=style, asymmetric=True, positions="ids"))


@pytest.mark.parametrize("layout", ["sbhd", "bhsd", "thd"])
def test_forward_layouts(layout):
    check_forward(Case(layout=layout, dtype="bf16",
                       positions="ids" if layout == "thd" else "arange"))


@pytest.mark.parametrize("case", [
    Case(d=16, rot=8, style="interleaved", source="half", dtype="fp16"),
    Case(d=20, rot=12, dtype="fp32", positions="ids"),  # R/2 = 6 and a tail of 8: masked blocks
    Case(d=12, rot=4, style="interleaved", dtype="bf16", source="computed"),
], ids=["interleaved-half-table", "odd-pairs-tail", "computed-short"])
def test_forward_partial_rotary(case):
    check_forward(case)


@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
def test_forward_computed_angles_with_ids(style):
    check_forward(Case(style=style, source="computed", positions="ids", base=500000.0))


@pytest.mark.parametrize("dtype,weight_dtype", [("fp32", "fp32"), ("bf16", "fp32"),
                                                 ("fp16", "bf16")])
def test_forward_gemma_and_weight_dtypes(dtype, weight_dtype):
    check_forward(Case(dtype=dtype, weight_dtype=weight_dtype, gemma=True))
    check_forward(Case(dtype=dtype, weight_dtype=weight_dtype, hk=1))  # MQA


def test_forward_strided_views_of_packed_qkv():
    """q and k cut out of one packed projection (heads of q, k and v side by side)."""
    b, s, hq, hk, d = 2, 3, 4, 2, 16
    qkv = torch.randn(b, s, hq + 2 * hk, d).to(Case().device)
    q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hk]
    qw, kw = torch.randn(d).to(q.device), torch.randn(d).to(q.device)
    cos, sin = tables.rope_tables(s, d, device=q.device)
    qo, ko = qk_norm_rope(q, k, qw, kw, EPS, cos=cos, sin=sin)
    qc, kc = qk_norm_rope(q.contiguous(), k.contiguous(), qw, kw, EPS, cos=cos, sin=sin)
    assert torch.equal(qo, qc) and torch.equal(ko, kc)


def test_forward_in_place_equals_out_of_place():
    c = Case(dtype="bf16", style="interleaved", rot=8, positions="ids")
    check_forward(c, in_place=True)
    inp = make_case(c)
    qo, ko = qk_norm_rope(inp["q"], inp["k"], inp["qw"], inp["kw"], EPS, **inp["kwargs"])
    qk_norm_rope_inplace(inp["q"], inp["k"], inp["qw"], inp["kw"], EPS, **inp["kwargs"])
    assert torch.equal(qo, inp["q"]) and torch.equal(ko, inp["k"])


def test_forward_matches_transformers_in_fp32():
    """Qwen3's q_norm then HF's rotate-half RoPE, in fp32: the same as the fused kernel to the
    fp32 tolerance (in fp16/bf16 transformers rounds four times more; see the module doc)."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from reference.eager import hf_apply_rotary_pos_emb

    c = Case(layout="bshd")
    inp = make_case(c)
    norm_q, norm_k = Qwen3RMSNorm(c.d, eps=EPS), Qwen3RMSNorm(c.d, eps=EPS)
    with torch.no_grad():
        norm_q.weight.copy_(inp["qw"].cpu())
        norm_k.weight.copy_(inp["kw"].cpu())
        cos = inp["kwargs"]["cos"].cpu()[: c.s].expand(c.b, c.s, c.d)
        sin = inp["kwargs"]["sin"].cpu()[: c.s].expand(c.b, c.s, c.d)
        hq, hk = hf_apply_rotary_pos_emb(norm_q(inp["q"].cpu()), norm_k(inp["k"].cpu()),
                                         cos, sin, unsqueeze_dim=2)
    qo, ko = qk_norm_rope(inp["q"], inp["k"], inp["qw"], inp["kw"], EPS, **inp["kwargs"])
    for out, hf, x, w in ((qo, hq, inp["q"], inp["qw"]), (ko, hk, inp["k"], inp["kw"])):
        ref = qk_norm_rope_oracle(x, w, EPS, **_oracle_kw(c, inp))
        tol = 2 * forward_tolerance(ref, rms_norm(x, w, EPS), x.dtype, c.d)
        _close(out, hf.double(), tol, "fused vs transformers")


# ---- backward ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
def test_backward_asymmetric_tables(dtype, style):
    check_backward(Case(dtype=dtype, style=style, asymmetric=True))


@pytest.mark.parametrize("case", [
    Case(d=20, rot=12, asymmetric=True, layout="sbhd"),
    Case(d=16, rot=8, style="interleaved", source="half", dtype="bf16", weight_dtype="fp32",
         layout="bhsd"),
    Case(source="computed", positions="ids", gemma=True, hk=1),
    Case(layout="thd", positions="ids", gemma=True, dtype="fp16", asymmetric=True),
], ids=["partial-sbhd", "partial-interleaved-bhsd", "computed-gemma-mqa", "thd-gemma"])
def test_backward_cases(case):
    check_backward(case)


def test_backward_zero_stride_gradient():
    check_backward(Case(dtype="bf16", asymmetric=True), broadcast_grad=True)


def test_backward_tokens_per_program_follows_the_grid(monkeypatch):
    """One token a program while the grid fits the budget, then the shortest run that keeps it
    within BACKWARD_PROGRAMS_PER_SM programs per SM."""
    monkeypatch.setattr(qknr, "sm_count", lambda index: 132)
    monkeypatch.setattr(qknr, "FORCED", {"BACKWARD_PROGRAMS_PER_SM": 8})
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert qknr.backward_tokens_per_program(64, 3, gpu) == 1
    assert qknr.backward_tokens_per_program(352, 3, gpu) == 1      # 1056 programs: the budget
    assert qknr.backward_tokens_per_program(353, 3, gpu) == 2
    assert qknr.backward_tokens_per_program(4096, 3, gpu) == 12     # 1024 programs
    assert qknr.backward_tokens_per_program(64, 3, cpu) == 24       # the interpreter: one SM
    assert qknr.backward_tokens_per_program(0, 3, gpu) == 1


def test_backward_several_tokens_per_program_is_deterministic(monkeypatch):
    """Several tokens a program (8 slots a group, every third token, the last slot past the end),
    the heads in blocks of 2 (3 q heads: a partial block): correct, and the weight gradients
    bitwise equal from run to run."""
    monkeypatch.setattr(qknr, "sm_count", lambda index: 1)
    monkeypatch.setattr(qknr, "FORCED", {"BACKWARD_PROGRAMS_PER_SM": 8})
    monkeypatch.setattr(qknr, "HEAD_BWD_BLOCK_ELEMENTS",
                        dict.fromkeys(qknr.HEAD_BWD_BLOCK_ELEMENTS, 16))
    c = Case(b=3, s=7, hq=3, hk=1, d=8, asymmetric=True)  # 21 tokens: 3 groups of 7
    assert qknr.backward_tokens_per_program(21, 3, torch.device(c.device)) == 8
    first = check_backward(c)
    second = check_backward(c)
    for name in ("dq", "dk", "dqw", "dkw"):
        assert torch.equal(first[name], second[name]), name


def test_backward_minimal_kernel_keeps_every_load(monkeypatch):
    """HEAD_BWD_MINIMAL (the probes' minimal kernel): dx = dy + x * sin and the weight-gradient
    rows sum x * cos, so every load (x, dy, both members' cos and sin) reaches an output; every
    element written (NaN-poisoned allocations). Asymmetric fp32 tables, two groups of tokens."""
    monkeypatch.setattr(qknr, "HEAD_BWD_MINIMAL", True)
    monkeypatch.setattr(qknr, "FORCED", {"BACKWARD_PROGRAMS_PER_SM": 8})
    c = Case(b=2, s=5, hq=3, hk=1, d=8, asymmetric=True)
    inp = make_case(c)
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(inp[n].shape, generator=gen).to(c.device) for n in ("q", "k")]
    with _alloc.poisoned():
        dq, dk, dqw, dkw = qknr.backward(*grads, inp["q"], inp["k"], inp["qw"], inp["kw"], EPS,
                                         positions=None, **inp["kwargs"])
    rows = inp["pos"].reshape(c.b, c.s, 1, 1)  # [b, s, 1, 1]: token (j, i)'s row
    cos, sin = (t[rows.squeeze(-1).squeeze(-1)][:, :, None, :] for t in (inp["cos64"],
                                                                         inp["sin64"]))
    for x, g, dx, dw in ((inp["q"], grads[0], dq, dqw), (inp["k"], grads[1], dk, dkw)):
        x64, g64 = x.double().cpu(), g.double().cpu()
        torch.testing.assert_close(dx.double().cpu(), g64 + x64 * sin, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dw.double().cpu(), (x64 * cos).sum((0, 1, 2)), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("q_rows,k_rows,q_cols,k_cols,dtype", [
    (300, 131, 24, 24, torch.bfloat16),    # rows past one block of 128, columns past 8
    (5, 0, 6, 6, torch.float16),           # fewer columns than a block; no k rows (zeros)
    (129, 64, 40, 8, torch.float32),       # the token norm's [hq * d] and [hk * d] columns
])
def test_weight_grads_sum_the_rows(q_rows, k_rows, q_cols, k_cols, dtype):
    """The weight gradients' reduction: each buffer's column sums, in the weight's dtype, every
    element written (NaN-poisoned allocations), and equal from run to run."""
    dev = Case().device
    g = torch.Generator().manual_seed(3)
    qpart = torch.randn(q_rows, q_cols, generator=g).to(dev)
    kpart = torch.randn(k_rows, k_cols, generator=g).to(dev)
    qw = torch.empty(q_cols, dtype=dtype, device=dev)
    kw = torch.empty(k_cols, dtype=dtype, device=dev)
    with _alloc.poisoned():
        dqw, dkw = qknr.weight_grads(qpart, kpart, qw, kw)
    for got, part in ((dqw, qpart), (dkw, kpart)):
        want = part.double().sum(0)
        assert got.dtype == dtype and got.shape == want.shape
        tol = float(part.double().abs().sum(0).max()) * 2.0**-22 + 2 * float(
            want.abs().max()) * torch.finfo(dtype).eps if part.numel() else 0.0
        torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=0, atol=tol)
    again = qknr.weight_grads(qpart, kpart, qw, kw)
    assert torch.equal(again[0], dqw) and torch.equal(again[1], dkw)


def test_backward_only_one_output_used():
    """A gradient for q_out only: k's gradients are zeros, q's match the oracle."""
    c = Case(asymmetric=True)
    inp = make_case(c)
    leaves = [inp[n].detach().clone().requires_grad_(True) for n in ("q", "k", "qw", "kw")]
    qo, _ = qk_norm_rope(*leaves, EPS, **inp["kwargs"])
    qo.float().square().sum().backward()
    assert torch.count_nonzero(leaves[1].grad) == 0
    assert torch.count_nonzero(leaves[3].grad) == 0
    assert torch.count_nonzero(leaves[0].grad) > 0



def _qk_leaves(inp: dict) -> list[torch.Tensor]:
    return [inp[n].detach().clone().requires_grad_(True) for n in ("q", "k", "qw", "kw")]


@pytest.mark.parametrize("norm", ["head", "token"])
def test_backward_under_activation_checkpointing(norm):
    """The gradients through ``torch.utils.checkpoint`` (the forward run again in the backward,
    non-reentrant) are the plain backward's, bit for bit (PEERS.md's bug class 5: RoPE kernels
    whose gradients go wrong under checkpointing). The in-place form refuses a recorded
    gradient instead (test_refusals_of_unsupported_combinations)."""
    c = Case(dtype="bf16", asymmetric=True, norm=norm)
    inp = make_case(c)
    gen = torch.Generator().manual_seed(7)
    heads = torch.randn(c.hq, generator=gen).to(inp["q"].device)  # a loss that weighs heads

    def block(q, k, qw, kw):
        qo, ko = qk_norm_rope(q, k, qw, kw, EPS, **inp["kwargs"])
        return (qo.float() * heads.view(-1, 1)).square().sum() + ko.float().sum()

    plain = _qk_leaves(inp)
    want = torch.autograd.grad(block(*plain), plain)
    leaves = _qk_leaves(inp)
    loss = torch.utils.checkpoint.checkpoint(block, *leaves, use_reentrant=False)
    got = torch.autograd.grad(loss, leaves)
    for g, w, name in zip(got, want, ("dq", "dk", "dq_weight", "dk_weight")):
        assert torch.count_nonzero(w) > 0 and torch.equal(g, w), name


def test_backward_leaves_a_shared_incoming_gradient_alone():
    """``qo + other``'s backward hands one gradient tensor to both: the QK-norm's backward must
    not write into it (as an in-place backward would), so ``other`` gets exactly that gradient
    and the gradient itself is unchanged."""
    c = Case(dtype="bf16", asymmetric=True)
    inp = make_case(c)
    q, k, qw, kw = _qk_leaves(inp)
    other = torch.zeros_like(inp["q"], requires_grad=True)
    qo, ko = qk_norm_rope(q, k, qw, kw, EPS, **inp["kwargs"])
    g = torch.randn(qo.shape, generator=torch.Generator().manual_seed(3)).to(qo)
    g0 = g.clone()
    torch.autograd.backward([qo + other], [g])
    assert torch.equal(g, g0), "the incoming gradient was written"
    assert torch.equal(other.grad, g0)
    assert torch.count_nonzero(q.grad) > 0 and torch.count_nonzero(qw.grad) > 0

# ---- norm over all heads of a token (OLMo2) ------------------------------------------------------
TOKEN_CASES = [
    Case(norm="token"),
    Case(norm="token", dtype="bf16", style="interleaved", layout="sbhd", asymmetric=True),
    Case(norm="token", dtype="fp16", layout="bhsd", rot=8, source="half", hq=5, hk=3),
    Case(norm="token", layout="thd", positions="ids", gemma=True, weight_dtype="fp32"),
    Case(norm="token", source="computed", positions="ids", hk=1, d=20, rot=12),
    Case(norm="token", dtype="bf16", source="half", positions="ids", hq=5, hk=3),
    Case(norm="token", dtype="bf16", hq=16, hk=8, d=128, asymmetric=True),
    Case(norm="token", layout="thd", positions="ids", gemma=True, weight_dtype="bf16", hq=12,
         hk=8, d=64),
]
TOKEN_IDS = ["fp32", "bf16-interleaved-sbhd", "fp16-bhsd-partial-half-odd-heads",
             "thd-gemma", "computed-mqa-d20", "bf16-half-ids-odd-heads", "bf16-16-8-heads-of-128",
             "fp32-thd-gemma-12-8-heads-of-64"]
# The cases whose whole-token backward reads through TMA descriptors: rotate-half, no tail, a
# half of at least 16 bytes, batch-major tokens (bshd, thd), blocks of at least 1 KB.
TOKEN_TMA = {"fp32": False, "bf16-interleaved-sbhd": False,
             "fp16-bhsd-partial-half-odd-heads": False, "thd-gemma": False,
             "computed-mqa-d20": False, "bf16-half-ids-odd-heads": False,
             "bf16-16-8-heads-of-128": True, "fp32-thd-gemma-12-8-heads-of-64": True}


def _token_paths(monkeypatch, passes: str) -> list[bool]:
    """Force the two-pass kernels (forward and backward) for "blocks of heads"; returns the
    ``whole_token`` of every token-norm launch, recorded."""
    if passes == "blocks of heads":
        monkeypatch.setattr(qknr, "TOKEN_FWD_WHOLE_ELEMENTS", 0)
        monkeypatch.setattr(qknr, "TOKEN_BWD_WHOLE_ELEMENTS", 0)
    paths, blocks = [], qknr._token_blocks

    def recorded(*args, **kwargs):
        plan = blocks(*args, **kwargs)
        paths.append(plan[2])
        return plan

    monkeypatch.setattr(qknr, "_token_blocks", recorded)
    return paths


def _tma_reads(monkeypatch, passes: str) -> list[bool]:
    """TOKEN_BWD_TMA set where ``passes`` says "TMA" (and TOKEN_BWD_TMA_QK_TOGETHER where it
    says "together"), on one SM (the interpreter's count, on a GPU too: these cases' few tokens
    then give a program more than one, where TMA serves); returns, per whole-token backward that
    could read through TMA, whether it did, recorded."""
    monkeypatch.setattr(qknr, "TOKEN_BWD_TMA", "TMA" in passes)
    monkeypatch.setattr(qknr, "TOKEN_BWD_TMA_QK_TOGETHER",
                        dict.fromkeys((2, 4), int("together" in passes)))
    monkeypatch.setattr(qknr, "_sms", lambda device: 1)
    launch = qknr._backward_token_norm

    def checked(*args):  # q and k in one program exactly where asked for and through TMA
        bound = inspect.signature(launch).bind(*args).arguments
        assert bound["together"] == ("together" in passes and bound["descs"] is not None)
        return launch(*args)

    monkeypatch.setattr(qknr, "_backward_token_norm", checked)
    reads, descriptors = [], qknr._token_descriptors

    def recorded(*args):
        descs = descriptors(*args)
        reads.append(descs is not None)
        return descs

    monkeypatch.setattr(qknr, "_token_descriptors", recorded)
    return reads


@pytest.mark.parametrize("passes", ["whole tokens", "whole tokens, q and k apart",
                                    "blocks of heads"])
@pytest.mark.parametrize("case", TOKEN_CASES, ids=TOKEN_IDS)
def test_token_norm_forward(monkeypatch, case, passes):
    """Every forward: a token's heads whole, read once (these heads fit; angles from tables), its
    q and k in one program or in one each, and in blocks of one or two heads (the last block
    partial where the heads are odd), read twice (and angles computed in the kernel)."""
    paths = _token_paths(monkeypatch, passes)
    monkeypatch.setattr(qknr, "TOKEN_FWD_BLOCK_ELEMENTS", 16)
    monkeypatch.setitem(qknr.FORCED, "TOKEN_FWD_QK_TOGETHER", int(passes == "whole tokens"))
    check_forward(case)
    check_forward(case, in_place=True)
    whole = passes.startswith("whole tokens") and case.source != "computed"
    assert len(paths) == 2 and set(paths) == {whole}


def _token_forward_per_warp() -> list[int]:
    """TOKEN_FWD_ELEMENTS_PER_WARP's values: the module's and each shipped table's."""
    from ports.fastrope import tuning

    return sorted(tuning.qknorm_values("TOKEN_FWD_ELEMENTS_PER_WARP")
                  | {qknr.TOKEN_FWD_ELEMENTS_PER_WARP})


@pytest.mark.parametrize("together", [True, False], ids=["together", "apart"])
@pytest.mark.parametrize("per_warp", _token_forward_per_warp())
@pytest.mark.parametrize("case", TOKEN_CASES, ids=TOKEN_IDS)
def test_token_norm_forward_at_each_tables_elements_a_warp(monkeypatch, case, per_warp,
                                                           together):
    """The whole-token forward at the settings the module and the shipped tables choose from
    (its GPUs' builds: q and k in one program or in a program each, at each elements a warp,
    up to TOKEN_FWD_MOST_ELEMENTS_A_THREAD a thread; the H200's table takes them apart), on any
    GPU."""
    monkeypatch.setitem(qknr.FORCED, "TOKEN_FWD_ELEMENTS_PER_WARP", per_warp)
    monkeypatch.setitem(qknr.FORCED, "TOKEN_FWD_QK_TOGETHER", int(together))
    check_forward(case)
    check_forward(case, in_place=True)


def test_token_forward_warps_hold_q_and_k(monkeypatch):
    """The whole-token forward's program holds a token's q rows and k rows: its warps are the
    power of two at or below their elements over TOKEN_FWD_ELEMENTS_PER_WARP (Qwen3-8B's 32 + 8
    heads of 128: 2; 32 + 16: 2, not 3), more where a thread would hold more than
    TOKEN_FWD_MOST_ELEMENTS_A_THREAD (32 + 16 heads at 4096 elements a warp: 2, not 1), and the
    launcher halves the elements a warp, and holds TOKEN_FWD_MOST_STRIDED_ELEMENTS_A_THREAD at
    most, where a tensor's channels are strided (each element then loads alone, an address
    register each)."""
    from types import SimpleNamespace

    def warps(hq, hk, elements_per_warp, both=True, most=None):
        g = SimpleNamespace(q_heads=hq, k_heads=hk, head_dim=128)
        return qknr._token_blocks(g, 2048, 4, 8192, elements_per_warp, 1, both_tensors=both,
                                  most_per_thread=most)[3]

    assert (warps(32, 8, 2048), warps(32, 16, 2048), warps(32, 32, 2048)) == (2, 2, 4)
    assert (warps(32, 8, 1024), warps(32, 8, 2048, both=False)) == (4, 2)
    assert (warps(32, 8, 4096, most=160), warps(32, 16, 4096), warps(32, 16, 4096, most=160),
            warps(32, 16, 4096, most=48)) == (1, 1, 2, 4)
    # the module's elements a warp stay within every bound (its warps are the cap's)
    for most in (*qknr.TOKEN_FWD_MOST_ELEMENTS_A_THREAD.values(),
                 2 * qknr.TOKEN_FWD_MOST_STRIDED_ELEMENTS_A_THREAD):
        for hq, hk in ((32, 8), (32, 16), (16, 8), (64, 64), (1, 1)):
            assert warps(hq, hk, qknr.TOKEN_FWD_ELEMENTS_PER_WARP, most=most) == warps(
                hq, hk, qknr.TOKEN_FWD_ELEMENTS_PER_WARP)
    seen, blocks = [], qknr._token_blocks

    def recorded(*args, **kwargs):
        seen.append((args[4], kwargs["most_per_thread"]))  # elements a warp, a thread
        return blocks(*args, **kwargs)

    monkeypatch.setattr(qknr, "_token_blocks", recorded)
    c = Case(norm="token")
    inp = make_case(c)
    strided = torch.empty(*inp["q"].shape[:-1], 2 * c.d, dtype=inp["q"].dtype,
                          device=inp["q"].device)[..., ::2].copy_(inp["q"])
    outs = [qk_norm_rope(x, inp["k"], inp["qw"], inp["kw"], EPS, **inp["kwargs"])
            for x in (inp["q"], strided)]
    _, per_warp = qknr.token_forward_launch(c.b * c.s, strided.device)
    most = qknr.TOKEN_FWD_MOST_ELEMENTS_A_THREAD[strided.element_size(),
                                                 inp["qw"].element_size()]
    assert seen == [(per_warp, most),
                    (per_warp // 2, qknr.TOKEN_FWD_MOST_STRIDED_ELEMENTS_A_THREAD)]
    for a, b in zip(*outs):  # the same answer, up to the sums' order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens,sms,forced,launch", [
    (10, 132, False, (True, 1024)), (132, 132, False, (False, 4096)), (10, 8, False, (False, 4096)),
    (10, 132, True, (False, 4096))])
def test_token_forward_few_tokens_take_q_and_k_together_on_more_warps(monkeypatch, tokens, sms,
                                                                      forced, launch):
    """Fewer tokens than SMs (decode): the launcher takes q and k in one program, on at most
    TOKEN_FWD_FEW_TOKENS_ELEMENTS_PER_WARP elements a warp, whatever the GPU's values (apart at
    4096 here); otherwise, or where FORCED names the constants (the launch sweep's settings), those
    values. The answer is the oracle's either way."""
    seen, blocks = [], qknr._token_blocks

    def recorded(*args, **kwargs):
        seen.append((kwargs["both_tensors"], args[4]))
        return blocks(*args, **kwargs)

    monkeypatch.setattr(qknr, "_token_blocks", recorded)
    monkeypatch.setattr(qknr, "_sms", lambda device: sms)
    monkeypatch.setattr(qknr.tuning, "qknorm_constants", lambda index: {})  # a GPU without a table
    for name, value in (("TOKEN_FWD_QK_TOGETHER", 0), ("TOKEN_FWD_ELEMENTS_PER_WARP", 4096)):
        monkeypatch.setattr(qknr, name, value)  # ... whose module values are these
        if forced:
            monkeypatch.setitem(qknr.FORCED, name, value)
    check_forward(Case(b=1, s=tokens, hq=8, hk=2, d=64, dtype="bf16", norm="token"))
    assert set(seen) == {launch}


@pytest.mark.parametrize("style,rot,most", [("interleaved", 8, 128), ("interleaved", None, 160),
                                            ("rotate_half", 8, 160)])
def test_token_forward_interleaved_tail_holds_less(monkeypatch, style, rot, most):
    """16-bit rows and weights: a thread of the one-pass forward holds at most 160 elements, 128
    where interleaved pairs sit beside an unrotated tail (160 spilled there on sm_90); the answer
    is the oracle's either way."""
    seen, blocks = [], qknr._token_blocks

    def recorded(*args, **kwargs):
        seen.append(kwargs["most_per_thread"])
        return blocks(*args, **kwargs)

    monkeypatch.setattr(qknr, "_token_blocks", recorded)
    monkeypatch.setattr(qknr, "_sms", lambda device: 1)
    check_forward(Case(style=style, rot=rot, dtype="bf16", norm="token"))
    assert seen == [most]


BACKWARD_PASSES = ["whole tokens, TMA", "whole tokens, TMA, q and k together", "whole tokens",
                   "blocks of heads"]


@pytest.mark.parametrize("passes", BACKWARD_PASSES)
@pytest.mark.parametrize("case", TOKEN_CASES, ids=TOKEN_IDS)
def test_token_norm_backward(monkeypatch, case, passes):
    """Every backward: a token's heads whole, in one pass (these heads fit), read through TMA
    descriptors where the case allows it and else plain loads, or plain loads only; and in blocks
    of heads, in two passes (where a token's heads are too many for one block)."""
    paths = _token_paths(monkeypatch, passes)
    reads = _tma_reads(monkeypatch, passes)
    check_backward(case)
    assert paths and paths[-1] == (passes != "blocks of heads")  # the backward launches last
    if "TMA" in passes:
        assert reads and set(reads) == {TOKEN_TMA[TOKEN_IDS[TOKEN_CASES.index(case)]]}
    else:
        assert not reads


@pytest.mark.parametrize("passes", BACKWARD_PASSES)
def test_token_norm_backward_several_tokens_per_program(monkeypatch, passes):
    """Groups of 8 tokens (the last partly past the end), the heads whole (3 q heads in a block
    of 4; through TMA, the fourth head past the tensor) or in blocks of 2 (a partial block):
    correct, and the weight gradients bitwise equal from run to run."""
    monkeypatch.setattr(qknr, "LONG_RUN_MIN_TOKENS", 1)
    monkeypatch.setattr(qknr, "LONG_RUN_TOKENS", 8)
    monkeypatch.setattr(qknr, "TOKEN_BWD_TMA_TOKENS", 8)
    monkeypatch.setattr(qknr, "TOKEN_BWD_BLOCK_ELEMENTS", 512)
    paths = _token_paths(monkeypatch, passes)
    reads = _tma_reads(monkeypatch, passes)
    c = Case(b=3, s=7, hq=3, hk=2, d=256, asymmetric=True, norm="token")  # TMA blocks of 1 KB+
    first = check_backward(c)
    second = check_backward(c)
    for name in ("dq", "dk", "dqw", "dkw"):
        assert torch.equal(first[name], second[name]), name
    assert paths and set(paths) == {passes != "blocks of heads"}
    assert set(reads) == ({True} if "TMA" in passes else set())


def test_token_norm_backward_takes_q_and_k_together_in_16_bit(monkeypatch):
    """The shipped choice (TOKEN_BWD_TMA_QK_TOGETHER): through TMA, 16-bit rows take a token's q
    and k in one program (its tokens spread evenly: 5 of them over 2 programs on one SM, 3 a
    program); fp32 rows a program each (a power of two tokens a program: 8)."""
    monkeypatch.setattr(qknr, "_sms", lambda device: 1)
    seen, launch = [], qknr._backward_token_norm

    def recorded(*args):
        a = inspect.signature(launch).bind(*args).arguments
        seen.append((a["dq_out"].dtype, a["descs"] is not None, a["together"], a["tpp"]))
        return launch(*args)

    monkeypatch.setattr(qknr, "_backward_token_norm", recorded)
    check_backward(Case(b=1, s=5, hq=16, hk=8, d=128, dtype="bf16", asymmetric=True,
                        norm="token"))
    check_backward(Case(b=1, s=5, hq=12, hk=8, d=64, layout="thd", positions="ids",
                        gemma=True, norm="token"))
    assert seen == [(torch.bfloat16, True, True, 3), (torch.float32, True, False, 8)]


@pytest.mark.parametrize("passes", ["whole tokens, TMA", "whole tokens, TMA, q and k together"])
def test_token_norm_backward_one_token_a_program_skips_tma(monkeypatch, passes):
    """Where each program would take one token (on the interpreter's one SM: one token over a q
    and a k program, or two tokens over two programs of both), TMA has no later token to stage:
    the backward reads with plain loads, and is correct; one token more, it reads through TMA."""
    reads = _tma_reads(monkeypatch, passes)
    most = 2 if "together" in passes else 1
    check_backward(Case(b=1, s=most, hq=3, hk=2, d=256, asymmetric=True, norm="token"))
    assert not reads
    check_backward(Case(b=1, s=most + 1, hq=3, hk=2, d=256, asymmetric=True, norm="token"))
    assert reads == [True]


def test_token_norm_differs_from_head_norm():
    """The same q under the two norms: the oracle tells them apart (a kernel computing the other
    norm would fail check_forward), and each kernel matches its own."""
    c = Case(norm="token")
    inp = make_case(c)
    tiled = dict(inp["kwargs"])
    tiled.pop("norm")
    head = qk_norm_rope(inp["q"], inp["k"], inp["qw"][: c.d], inp["kw"][: c.d], EPS, **tiled)[0]
    token = qk_norm_rope(inp["q"], inp["k"], inp["qw"], inp["kw"], EPS, **inp["kwargs"])[0]
    assert (head - token).abs().max() > 1e-2


def test_token_norm_opcheck():
    c = Case(b=1, s=3, hq=2, hk=1, d=8, norm="token")
    inp = make_case(c)
    kw = inp["kwargs"]
    q, k, qw, kw_ = (inp[n].detach().clone().requires_grad_(True) for n in ("q", "k", "qw", "kw"))
    rest = (EPS, kw.get("cos"), kw.get("sin"), kw.get("positions"), c.style, c.layout, c.rot,
            c.base, c.gemma)
    torch.library.opcheck(torch.ops.fastrope.qk_norm_rope.default,
                          (q, k, qw, kw_, *rest, True, "token"))
    g = [torch.randn_like(q), torch.randn_like(k)]
    torch.library.opcheck(torch.ops.fastrope.qk_norm_rope_backward.default,
                          (*g, *(t.detach() for t in (q, k, qw, kw_)), *rest, "token"))


def test_token_norm_refusals():
    q, k, qw, kw, kwargs = _base_args()
    with pytest.raises(ValueError, match=r"q_weight must be \[heads \* head_dim = 4 \* 16\]"):
        qk_norm_rope(q, k, qw, kw, EPS, norm="token", **kwargs)
    with pytest.raises(ValueError, match="unknown norm"):
        qk_norm_rope(q, k, qw, kw, EPS, norm="tokens", **kwargs)
    with pytest.raises(TypeError, match="norm must be strings"):
        qk_norm_rope(q, k, qw, kw, EPS, norm=None, **kwargs)


# ---- refusals ------------------------------------------------------------------------------------
def _base_args(device=None):
    c = Case() if device is None else Case(device=device)
    inp = make_case(c)
    return inp["q"], inp["k"], inp["qw"], inp["kw"], inp["kwargs"]


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(q=a["q"].double()), TypeError, "q has dtype float64"),
    (lambda a: a.update(k=a["k"].half()), TypeError, "k has dtype float16 but q"),
    (lambda a: a.update(qw=a["qw"][:8]), ValueError, r"q_weight must be \[head_dim = 16\]"),
    (lambda a: a.update(kw=a["kw"].long()), TypeError, "k_weight has dtype int64"),
    (lambda a: a.update(k=a["k"][:, :3]), ValueError, "must match in every dimension"),
    (lambda a: a.update(eps=-1.0), ValueError, "eps must be a finite number"),
    (lambda a: a["kw_"].update(rotary_dim=7), ValueError, "rotary_dim must be even"),
    (lambda a: a["kw_"].update(layout="bsdh"), ValueError, "unknown layout"),
    (lambda a: a["kw_"].update(style="neox"), ValueError, "unknown style"),
    (lambda a: a["kw_"].pop("sin"), ValueError, "pass both cos and sin"),
    (lambda a: a["kw_"].update(cos=a["kw_"]["cos"][:, :5], sin=a["kw_"]["sin"][:, :5]),
     ValueError, r"cos must be \[max_position, rotary_dim=16\]"),
    (lambda a: a["kw_"].update(positions=torch.zeros(2, 5, device=a["q"].device)), TypeError,
     "positions must be int"),
    (lambda a: a["kw_"].update(positions=torch.zeros(3, 5, dtype=torch.int64,
                                                           device=a["q"].device)), ValueError,
     "positions must have shape"),
    (lambda a: a["kw_"].update(positions=torch.full((2, 5), 99, device=a["q"].device)), IndexError,
     "positions reach"),
    (lambda a: a["kw_"].update(gemma=1), TypeError, "gemma must be a bool"),
], ids=["q-dtype", "k-dtype", "weight-shape", "weight-dtype", "k-shape", "eps", "rotary-odd",
        "layout", "style", "cos-alone", "table-width", "pos-float", "pos-shape", "pos-range",
        "gemma-int"])
def test_bad_arguments_raise(change, error, match):
    q, k, qw, kw, kwargs = _base_args()
    a = dict(q=q, k=k, qw=qw, kw=kw, eps=EPS, kw_=dict(kwargs))
    change(a)
    with pytest.raises(error, match=match):
        qk_norm_rope(a["q"], a["k"], a["qw"], a["kw"], a["eps"], **a["kw_"])


def test_refusals_of_unsupported_combinations():
    q, k, qw, kw, kwargs = _base_args()
    with pytest.raises(NotImplementedError, match="thd' needs per-token positions"):
        qk_norm_rope(q[0], k[0], qw, kw, EPS, layout="thd")
    with pytest.raises(NotImplementedError, match="use qk_norm_rope when a gradient"):
        qk_norm_rope_inplace(q.clone().requires_grad_(True), k.clone(), qw, kw, EPS, **kwargs)
    with pytest.raises(ValueError, match="same memory"):
        qk_norm_rope_inplace(q, q, qw, qw, EPS, **kwargs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'offsets'"):
        qk_norm_rope(q, k, qw, kw, EPS, offsets=3)


def test_empty_inputs():
    """No tokens, or no k heads: outputs of the right shapes, zero weight gradients."""
    dev = Case().device
    for qs, ks in (((2, 0, 4, 16), (2, 0, 2, 16)), ((2, 3, 4, 16), (2, 3, 0, 16))):
        q, k = torch.randn(qs, device=dev, requires_grad=True), torch.randn(ks, device=dev)
        w = torch.randn(16, device=dev, requires_grad=True)
        qo, ko = qk_norm_rope(q, k, w, w.detach(), EPS)
        assert qo.shape == qs and ko.shape == ks
        qo.sum().backward()
        assert w.grad.shape == (16,) and (q.grad.shape == qs)


def test_nan_poison_is_seen():
    """The harness can fail: a kernel that skipped the k launch would leave NaN, which _close
    rejects."""
    with pytest.raises(AssertionError, match="NaN"):
        _close(torch.full((2,), float("nan")), torch.zeros(2, dtype=torch.float64),
               torch.tensor(1.0, dtype=torch.float64), "poisoned")


# ---- custom ops: opcheck and tracing -------------------------------------------------------------
def _op_args(c: Case, seed: int = 0) -> tuple:
    inp = make_case(c, seed)
    kw = inp["kwargs"]
    return (inp["q"], inp["k"], inp["qw"], inp["kw"], EPS, kw.get("cos"), kw.get("sin"),
            kw.get("positions"), c.style, c.layout, c.rot, c.base, c.gemma, True)


@pytest.mark.parametrize("case", [
    Case(b=1, s=3, hq=2, hk=1, d=8),
    Case(b=1, s=3, hq=2, hk=1, d=8, rot=4, style="interleaved", source="half",
         positions="ids", gemma=True, layout="sbhd"),
    Case(b=1, s=3, hq=2, hk=1, d=8, source="computed", dtype="bf16", weight_dtype="fp32"),
], ids=["tables", "partial-half-ids-gemma", "computed-bf16"])
def test_opcheck(case):
    args = _op_args(case)
    q, k, qw, kw = (t.detach().clone().requires_grad_(True) for t in args[:4])
    torch.library.opcheck(torch.ops.fastrope.qk_norm_rope.default, (q, k, qw, kw, *args[4:]))
    g = [torch.randn_like(q), torch.randn_like(k)]
    torch.library.opcheck(torch.ops.fastrope.qk_norm_rope_backward.default,
                          (*g, *(t.detach() for t in (q, k, qw, kw)), *args[4:-1]))
    torch.library.opcheck(torch.ops.fastrope.qk_norm_rope_.default,
                          (args[0].clone(), args[1].clone(), *args[2:]))


def test_fake_implementations_on_meta():
    args = _op_args(Case(layout="sbhd"))
    meta = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    qo, ko = torch.ops.fastrope.qk_norm_rope(*meta)
    assert qo.shape == args[0].shape and qo.is_contiguous() and ko.dtype == args[1].dtype
    outs = torch.ops.fastrope.qk_norm_rope_backward(meta[0], meta[1], *meta[:-1])
    assert [o.shape for o in outs] == [a.shape for a in args[:4]]


def test_traced_whole_by_dynamo():
    """fullgraph tracing (aot_eager: no code generation on this machine) of a forward and
    backward, equal to eager; the GPU suite repeats it with inductor."""
    c = Case(asymmetric=True)
    inp = make_case(c)
    kw = inp["kwargs"]

    def step(q, k, qw, kw_):
        qo, ko = qk_norm_rope(q, k, qw, kw_, EPS, **kw)
        return qo * 2, ko

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [inp[n].detach().clone().requires_grad_(True) for n in ("q", "k", "qw", "kw")]
    eager_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out_c = compiled(*leaves)
    out_e = step(*eager_leaves)
    for a, b in zip(out_c, out_e):
        assert torch.equal(a, b)
    sum(o.float().sum() for o in out_c).backward()
    sum(o.float().sum() for o in out_e).backward()
    for a, b in zip(leaves, eager_leaves):
        assert torch.equal(a.grad, b.grad)


def test_case_builder_hand_checked():
    """The oracle's conventions on a 4-element head (d = 4, R = 4, weight 1, rotate-half):
    rmsnorm([1, 1, 1, 1]) = [1, 1, 1, 1]; at angle pi/2 for pair 0 (and 0 for pair 1), RoPE
    sends (x0, x2) -> (-x2, x0) and leaves (x1, x3)."""
    x = torch.ones(1, 1, 1, 4, dtype=torch.float64)
    cos = torch.tensor([[0.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    sin = torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    x = x * torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    y = qk_norm_rope_oracle(x, torch.ones(4), 0.0, cos, sin, torch.zeros(1, 1, dtype=torch.long),
                            layout="bshd", style="rotate_half")
    r = (30 / 4) ** -0.5
    want = torch.tensor([-3 * r, 2 * r, 1 * r, 4 * r], dtype=torch.float64)
    torch.testing.assert_close(y.flatten(), want)
    dev = Case().device
    qo, ko = qk_norm_rope(x.float().to(dev), x.float().to(dev), torch.ones(4, device=dev),
                          torch.zeros(4, device=dev), 0.0, cos=cos.float().to(dev),
                          sin=sin.float().to(dev), positions=torch.zeros(1, 1, dtype=torch.int32,
                                                                         device=dev))
    torch.testing.assert_close(qo.double().cpu().flatten(), want)
    assert torch.count_nonzero(ko) == 0  # weight 0 (not Gemma): every output channel 0


# ---- the kernels compile for sm_90 (no GPU needed) ---------------------------------------------
_COMPILE_SM90 = r"""
import shutil, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ports.fastrope import qknorm as Q, qknorm_kernels as K, tuning

POINTERS = {"q_ptr", "k_ptr", "qo_ptr", "ko_ptr", "gq_ptr", "gk_ptr", "dq_ptr", "dk_ptr"}

def token_forward_per_warp():  # elements a warp: the module's, few tokens', each table's
    return sorted({Q.TOKEN_FWD_ELEMENTS_PER_WARP, Q.TOKEN_FWD_FEW_TOKENS_ELEMENTS_PER_WARP}
                  | tuning.qknorm_values("TOKEN_FWD_ELEMENTS_PER_WARP"))

def token_forward_warps(together, per_warp, weights_as_rows=False):
    # the launcher's rule for 32 + 8 heads of 128 and the weights the builds read (fp32, or the
    # rows' dtype): (item, aligned) -> warps; the build that knows nothing of its strides stands
    # for strided channels (half the elements a warp)
    from types import SimpleNamespace
    g = SimpleNamespace(q_heads=32, k_heads=8, head_dim=128)
    def warps(item, aligned, interleaved_tail):
        shrink = 1 if aligned else 2
        most = Q.token_forward_most_a_thread(item, item if weights_as_rows else 4,
                                             contiguous=aligned,
                                             interleaved_tail=interleaved_tail)
        return Q._token_blocks(g, Q.TOKEN_FWD_BLOCK_ELEMENTS, Q.TOKEN_FWD_WARPS,
                               Q.TOKEN_FWD_WHOLE_ELEMENTS, per_warp // shrink, 1,
                               both_tensors=together, most_per_thread=most)[3]
    return warps

def signature(fn, dtype, consts, weights="fp32"):
    types = {"qw_ptr": "*" + weights, "kw_ptr": "*" + weights, "qpart_ptr": "*fp32",
             "kpart_ptr": "*fp32",
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "inv_ptr": "*fp64", "pos_ptr": "*i64",
             "eps": "fp32"}
    half = consts["D"] // 2
    for x, heads in (("q", consts["BLOCK_HQ"]), ("k", consts["BLOCK_HK"])):
        for name in (x + "_desc", "g" + x + "_desc"):  # the TMA descriptors' blocks
            types[name] = f"tensordesc<{dtype}[1, 1, {heads}, {half}]>"
        types["d" + x + "_desc"] = f"tensordesc<{dtype}[1, 1, {heads}, {consts['D']}]>"
        types[x + "w_desc"] = f"tensordesc<fp32[{heads}, {half}]>"
        types[x + "part_desc"] = f"tensordesc<fp32[1, {heads}, {half}]>"
    return {n: "constexpr" if n in consts else "*" + dtype if n in POINTERS
            else types.get(n, "i32") for n in fn.arg_names}

NO_DESCS = dict.fromkeys(("q_desc", "k_desc", "gq_desc", "gk_desc", "dq_desc", "dk_desc",
                          "qw_desc", "kw_desc", "qpart_desc", "kpart_desc"))
# The TMA path, and the one-pass forward where it reads its rows whole, take rows whose channels
# are contiguous: their channel strides (the forward's outputs' too), and the weights' and
# tables' column strides of contiguous inputs, are 1, which a launch compiles as constants (Triton
# specializes an int argument equal to 1); their register budget is measured that way.
UNIT_STRIDES = dict.fromkeys(("sqd", "skd", "sgqd", "sgkd", "sdqd", "sdkd", "sqod", "skod", "sqw",
                              "skw", "tsc"), 1)

for fn, extra, elements, warps in (
        (K.qk_norm_rope_fwd_kernel, {}, Q.HEAD_FWD_BLOCK_ELEMENTS, Q.HEAD_FWD_WARPS),
        # (MINIMAL, the probes' minimal kernel, off as every launch but theirs has it)
        (K.qk_norm_rope_bwd_kernel, {"STAGES": Q.BACKWARD_STAGES, "PDL": True, "MINIMAL": False},
         None, Q.BACKWARD_WARPS),
        (K.qk_token_norm_rope_fwd_kernel, {"WHOLE_TOKEN": False, "QK_TOGETHER": False},
         Q.TOKEN_FWD_BLOCK_ELEMENTS, Q.TOKEN_FWD_WARPS),
        # whole tokens, q's 32 heads and k's 8 in one program or apart, on the launcher's warps
        # at each elements-a-warp value the module or a shipped table sets: where the channels
        # are not known contiguous (every element then loads alone) half its elements a warp
        *((K.qk_token_norm_rope_fwd_kernel, {"WHOLE_TOKEN": True, "QK_TOGETHER": together,
                                             "TABLES_ONLY": True, "CONTIGUOUS_WHEN_ALIGNED": True},
           Q.TOKEN_FWD_WHOLE_ELEMENTS, token_forward_warps(together, per_warp))
          for together in (True, False) for per_warp in token_forward_per_warp()),
        # and with weights in the rows' dtype (a bf16 model's own), q and k together (every
        # shipped table's choice): 16-bit weights let a thread hold more of a token (the H200's
        # 4096 elements a warp puts 32 + 8 heads of 128 on one warp, at 230-255 registers)
        *((K.qk_token_norm_rope_fwd_kernel, {"WHOLE_TOKEN": True, "QK_TOGETHER": True,
                                             "TABLES_ONLY": True, "CONTIGUOUS_WHEN_ALIGNED": True,
                                             "WEIGHTS_AS_ROWS": True},
           Q.TOKEN_FWD_WHOLE_ELEMENTS, token_forward_warps(True, per_warp, True))
          for per_warp in token_forward_per_warp()),
        (K.qk_token_norm_rope_bwd_kernel, {"TOKENS_PER_PROGRAM": Q.LONG_RUN_TOKENS,
                                           "WHOLE_TOKEN": False, "TMA": False, **NO_DESCS,
                                           "QK_TOGETHER": False, "STAGES": Q.TOKEN_BWD_STAGES,
                                           "PDL": True},
         Q.TOKEN_BWD_BLOCK_ELEMENTS, Q.BACKWARD_WARPS),
        (K.qk_token_norm_rope_bwd_kernel, {"TOKENS_PER_PROGRAM": Q.LONG_RUN_TOKENS,
                                           "WHOLE_TOKEN": True, "TMA": False, **NO_DESCS,
                                           "QK_TOGETHER": False, "STAGES": Q.TOKEN_BWD_STAGES,
                                           "PDL": True},
         Q.TOKEN_BWD_WHOLE_ELEMENTS,
         max(Q.BACKWARD_WARPS, 32 * 128 // Q.TOKEN_BWD_ELEMENTS_PER_WARP)),
        # through TMA, q and k apart and together
        # (a runtime count of tokens a program; the constexpr one unused)
        *((K.qk_token_norm_rope_bwd_kernel, {"TOKENS_PER_PROGRAM": 1,
                                             "WHOLE_TOKEN": True, "TMA": True,
                                             **{n: 1 for n in UNIT_STRIDES
                                                if n in K.qk_token_norm_rope_bwd_kernel.arg_names},
                                             "QK_TOGETHER": together,
                                             "STAGES": Q.TOKEN_BWD_TMA_STAGES,
                                             "PDL": True, "TABLES_ONLY": True},
           Q.TOKEN_BWD_WHOLE_ELEMENTS, None) for together in (False, True))):
    tma = extra.get("TMA", False)
    contiguous_when_aligned = extra.pop("CONTIGUOUS_WHEN_ALIGNED", False)
    weights_as_rows = extra.pop("WEIGHTS_AS_ROWS", False)
    # the one-pass forward and the TMA backward never compute angles (the launcher's rule)
    computed = K.TABLE_FULL if extra.pop("TABLES_ONLY", False) else K.TABLE_COMPUTED
    for dtype, table, interleaved, tail in (("bf16", K.TABLE_HALF, False, False),
                                            ("fp16", computed, tma is False, tma is False),
                                            ("fp32", K.TABLE_FULL, False, tma is False)):
        block = elements or Q.HEAD_BWD_BLOCK_ELEMENTS[4 if dtype == "fp32" else 2, tail]
        consts = dict(D=96 if tail else 128, HALF=24 if tail else 64,
                      PAIR_BLOCK=32 if tail else 64, TAIL_BLOCK=64 if tail else 1,
                      BLOCK_HQ=Q._block_heads(32, 96 if tail else 128, block),
                      BLOCK_HK=Q._block_heads(8, 96 if tail else 128, block),
                      INTERLEAVED=interleaved, TABLE=table,
                      HAS_POS=tail, GEMMA=tail, HAS_TAIL=tail, **extra)
        if tma:  # the launcher's warps for 32 heads of 128, by element size
            item = 4 if dtype == "fp32" else 2
            warps = max(Q.BACKWARD_WARPS, 32 * 128 // Q.TOKEN_BWD_TMA_ELEMENTS_PER_WARP[item])
        # Two builds: with nothing known of the int and pointer arguments, and as a launch on
        # 16-byte aligned tensors whose sizes and strides are multiples of 16 specializes them
        # (Triton marks such arguments divisible by 16): Qwen3-8B's launches are of that kind,
        # and the two allocate registers differently. ``contiguous_when_aligned``: the second
        # also has unit channel strides, as contiguous tensors specialize them, and each build
        # its own warps.
        for aligned in (False, True):
            build = dict(consts, **{n: 1 for n in UNIT_STRIDES if n in fn.arg_names}) \
                if aligned and contiguous_when_aligned else consts
            sig = signature(fn, dtype, build, dtype if weights_as_rows else "fp32")
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                     if aligned and sig[n] not in ("constexpr", "fp32")
                     and not sig[n].startswith("tensordesc")}
            k = triton.compile(ASTSource(fn, sig, build, attrs), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps(2 if dtype != "fp32" else 4, aligned,
                                                         interleaved and tail)
                                        if callable(warps) else warps})
            ptxas = shutil.which("ptxas")
            if ptxas:
                with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                    f.write(k.asm["ptx"])
                    f.flush()
                    err = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", "/dev/null"],
                                         capture_output=True, text=True).stderr
                spills = [line for line in err.splitlines() if "spill" in line]
                if any(" 0 bytes spill stores" not in line for line in spills):
                    sys.exit(f"{fn.__name__} {dtype} (aligned: {aligned}): register spills: "
                             f"{spills}")
            print("compiled", fn.__name__, dtype, "aligned" if aligned else "",
                  "weights as rows" if weights_as_rows else "")

for dtype in ("bf16", "fp16", "fp32"):
    fn = K.weight_grad_kernel
    consts = dict(BLOCK_R=Q.WEIGHT_GRAD_BLOCK_ROWS, BLOCK_C=Q.WEIGHT_GRAD_BLOCK_COLUMNS,
                  PDL=True)
    sig = {n: "constexpr" if n in consts else "*" + dtype if n in ("dqw_ptr", "dkw_ptr")
           else "*fp32" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": Q.WEIGHT_GRAD_WARPS})
    print("compiled", fn.__name__, dtype)
"""


def test_kernels_compile_for_sm90_without_spills():
    """The four kernels (per-head and per-token norm, forward and backward; the token norm's
    forward and backward each whole and in blocks of heads, the backward's whole tokens also
    through TMA descriptors), three variants each
    (dtypes, table forms, styles, tails, positions), each built twice (nothing known of its int
    and pointer arguments, and all of them divisible by 16, as aligned launches specialize them),
    and the weight gradients' reduction, compiled to sm_90 PTX by Triton (and through ptxas, with
    no register spill, when it is on PATH): a typing error the interpreter lets through fails
    here."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root
    r = subprocess.run([sys.executable, "-c", _COMPILE_SM90], capture_output=True, text=True,
                       cwd=root, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # 57 builds, and 12 more (3 dtypes, 2 builds, together and apart) for each further value of
    # the token forward's elements a warp: few tokens', and each a shipped table sets; then 6
    # for each value (3 dtypes, 2 builds) with the rows' dtype for the weights
    from ports.fastrope import tuning

    values = {qknr.TOKEN_FWD_ELEMENTS_PER_WARP, qknr.TOKEN_FWD_FEW_TOKENS_ELEMENTS_PER_WARP} \
        | tuning.qknorm_values("TOKEN_FWD_ELEMENTS_PER_WARP")
    assert r.stdout.count("compiled") == 57 + 12 * (len(values) - 1) + 6 * len(values)
    assert r.stdout.count("weights as rows") == 6 * len(values)
