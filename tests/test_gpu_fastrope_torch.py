"""fastrope as a PyTorch op on the GPU: any thread and device, the op matrix, torch.compile,
CUDA graphs and a Hugging Face Llama.

* Threads: a backward with a dense gradient as the first CUDA work on autograd's thread (a fresh
  process), calls from a new thread with no current CUDA context, and a call on cuda:1.
* ``torch.library.opcheck`` over the full argument matrix of tests/test_fastrope_ops.py, with
  the kernel.
* ``torch.compile(fullgraph=True, dynamic=True)`` of a small attention module: no graph break,
  one compile across sequence lengths, bit-exact against eager forward and backward.
* A captured decode step (default arguments: the position check is skipped during the capture)
  replayed with new positions and inputs, against eager calls.
* ``hf.apply_rotary_pos_emb`` against transformers' formula, and a patched Llama against the
  unpatched one (skipped without transformers).

Lines starting with ``REPORT`` (run with ``-s``) give the measured times and differences.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from ports.fastrope import api, apply_rope, apply_rope_inplace, hf, launcher, run
from ports.harness.timing import median_us
from reference.eager import hf_apply_rotary_pos_emb
from reference.tables import rope_tables
from test_fastrope_ops import _Attention, _case_args, _grads, _matrix, _qkv

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _report(*parts) -> None:
    print("REPORT", *parts, flush=True)


def _inputs(seed=0, b=2, s=33, h=4, hk=2, d=64, rows=64):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, s, h, d, device=DEV, generator=gen)
    k = torch.randn(b, s, hk, d, device=DEV, generator=gen)
    cos, sin = rope_tables(rows, d, device=DEV)
    return q, k, cos, sin


# ---- any thread, any device --------------------------------------------------------------------
_FIRST_BACKWARD = """
import torch
from ports.fastrope import apply_rope
from reference.tables import rope_tables
q = torch.randn(2, 16, 4, 64, device="cuda", requires_grad=True)
cos, sin = rope_tables(16, 64, device="cuda")
out = apply_rope(q, cos=cos, sin=sin)
dy = torch.randn_like(out)
out.backward(dy)  # autograd's device thread: its first CUDA work is this backward
want = apply_rope(dy, cos=cos, sin=-sin)  # the inverse rotation
torch.testing.assert_close(q.grad, want, rtol=1e-6, atol=1e-6)
print("backward ok")
"""


def test_dense_backward_as_the_first_work_on_autograds_thread():
    """out.backward(randn_like(out)) in a fresh process: the backward's launch is the first
    CUDA work of autograd's thread, which has no current context (a launch without one fails
    with CUDA_ERROR_INVALID_CONTEXT)."""
    done = subprocess.run([sys.executable, "-c", _FIRST_BACKWARD], cwd=ROOT, text=True,
                          capture_output=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0 and "backward ok" in done.stdout, done.stderr[-3000:]


def test_call_from_a_thread_with_no_current_context():
    """A new thread with no CUDA context current: the launch makes the device's primary context
    current (and restores the thread's none afterwards, unless a torch call of its own, e.g. the
    capture query of the position check, made the primary context current)."""
    q, k, cos, sin = _inputs()
    want_q, want_k = apply_rope(q, k, cos=cos, sin=sin)
    buffers = [q.clone(), k.clone()]
    result = {}

    def work():
        try:
            driver = launcher._driver()
            driver.ctxSetCurrent(0)
            apply_rope_inplace(*buffers, cos=cos, sin=sin, check_positions=False)
            result["context after"] = driver.ctxGetCurrent()
            result["out"] = apply_rope(q, k, cos=cos, sin=sin)
            torch.cuda.current_stream().synchronize()
        except BaseException as exc:  # re-raised in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    torch.cuda.synchronize()
    assert result["context after"] in (0, launcher.primary_context(q.get_device()))
    assert torch.equal(buffers[0], want_q) and torch.equal(buffers[1], want_k)
    assert torch.equal(result["out"][0], want_q) and torch.equal(result["out"][1], want_k)


def test_call_on_a_second_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs a second GPU; this machine has {torch.cuda.device_count()}")
    q, k, cos, sin = _inputs()
    want = apply_rope(q, k, cos=cos, sin=sin)
    dev1 = torch.device("cuda", 1)
    before = torch.cuda.current_device()
    got = apply_rope(*(t.to(dev1) for t in (q, k)), cos=cos.to(dev1), sin=sin.to(dev1))
    assert torch.cuda.current_device() == before
    torch.cuda.synchronize(dev1)
    assert all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))
    leaf = q.to(dev1).requires_grad_(True)  # and its backward, on that device's thread
    apply_rope(leaf, cos=cos.to(dev1), sin=sin.to(dev1)).backward(torch.ones_like(leaf))
    assert leaf.grad.device == dev1


# ---- opcheck -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", _matrix(full=True), ids=lambda c: "-".join(map(str, c)))
def test_opcheck_matrix(case):
    q, k, rest = _case_args(*case, device=DEV)
    q.requires_grad_(True)
    torch.library.opcheck(torch.ops.fastrope.rope.default, (q, k, *rest, False))
    torch.library.opcheck(torch.ops.fastrope.rope_.default,
                          (q.detach().clone(), None if k is None else k.clone(), *rest))
    outs = run.new_outputs([q.detach()] if k is None else [q.detach(), k])
    torch.library.opcheck(torch.ops.fastrope.rope_out.default,
                          (q.detach(), k, outs[0], outs[1] if k is not None else None, *rest,
                           False))


@pytest.mark.parametrize("in_place", [False, True])
def test_the_op_path_matches_the_direct_path(monkeypatch, in_place):
    """Through the ops (as traced: rope, or rope + copy_ in place) values and gradients are the
    eager path's, bit for bit."""
    q, k, cos, sin = _inputs()
    dys = [torch.randn_like(q), torch.randn_like(k)]

    def run(leaves):
        xs = [x.clone() for x in leaves] if in_place else leaves
        outs = (apply_rope_inplace if in_place else apply_rope)(*xs, cos=cos, sin=sin,
                                                                 offsets=5)
        return list(outs) + list(torch.autograd.grad(outs, leaves, dys))

    direct = run([q.clone().requires_grad_(True), k.clone().requires_grad_(True)])
    monkeypatch.setattr(api, "_direct", lambda: False)
    through_ops = run([q.clone().requires_grad_(True), k.clone().requires_grad_(True)])
    assert all(torch.equal(a, b) for a, b in zip(direct, through_ops))


# ---- gradients under activation checkpointing; a shared incoming gradient (PEERS.md class 5) ---
_B, _S, _H, _HK, _D, _WIDTH = 2, 33, 4, 2, 64, 96


def _projection_leaves(seed=11):
    """x [b, s, width] and the q and k projections' weights, fresh leaves; q and k are
    intermediates of the graph (a model's q_proj(x) and k_proj(x)), as the in-place form needs."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    shapes = [(_B, _S, _WIDTH), (_WIDTH, _H * _D), (_WIDTH, _HK * _D)]
    return [(torch.randn(*shape, device=DEV, generator=gen) / shape[0] ** 0.5).requires_grad_(True)
            for shape in shapes]


def _asymmetric_tables():
    """Tables whose pair members differ (cos's second half and sin's first half scaled): only
    the rotation's exact transpose, not the rotation by -theta, is their backward (PEERS.md
    class 6)."""
    cos, sin = rope_tables(_S + 7, _D, device=DEV)
    cos, sin = cos.clone(), sin.clone()
    cos[:, _D // 2:] *= 0.75
    sin[:, :_D // 2] *= 1.5
    return cos, sin


def _rotary_block(rope, cos, sin, positions):
    """q_proj, k_proj, RoPE, and a loss that weighs q's heads apart and k's sum."""
    head_weights = torch.linspace(-1.0, 2.0, _H, device=DEV).view(-1, 1)

    def block(x, wq, wk):
        q = (x @ wq).view(_B, _S, _H, _D)
        k = (x @ wk).view(_B, _S, _HK, _D)
        qo, ko = rope(q, k, cos=cos, sin=sin, positions=positions)
        return (qo * head_weights).square().sum() + ko.sum()

    return block


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("rope", [apply_rope, apply_rope_inplace], ids=["out_of_place", "in_place"])
def test_backward_under_activation_checkpointing(rope, reentrant):
    """``torch.utils.checkpoint`` runs the block's forward again in the backward (reentrant: on
    autograd's thread, inside a nested backward). The gradients are the plain backward's, bit for
    bit, and the plain ones are the float64 formula's (asymmetric tables, random positions)."""
    cos, sin = _asymmetric_tables()
    positions = torch.randint(0, _S + 7, (_B, _S), device=DEV,
                              generator=torch.Generator(device=DEV).manual_seed(5))
    block = _rotary_block(rope, cos, sin, positions)
    plain = _projection_leaves()
    block(*plain).backward()
    leaves = _projection_leaves()
    # .backward(), not autograd.grad: the reentrant form refuses the latter
    torch.utils.checkpoint.checkpoint(block, *leaves, use_reentrant=reentrant).backward()
    want, got = [x.grad for x in plain], [x.grad for x in leaves]
    for g, w, name in zip(got, want, ("dx", "dwq", "dwk")):
        assert torch.count_nonzero(w) > 0 and torch.equal(g, w), name

    def formula(q, k, cos, sin, positions):  # float64, as the reference rotates
        qo, ko = hf_apply_rotary_pos_emb(q, k, cos[positions], sin[positions], unsqueeze_dim=2)
        return qo, ko

    wide = [t.detach().double().requires_grad_(True) for t in _projection_leaves()]
    oracle = torch.autograd.grad(
        _rotary_block(formula, cos.double(), sin.double(), positions)(*wide), wide)
    for w, o, name in zip(want, oracle, ("dx", "dwq", "dwk")):
        atol = 64 * torch.finfo(torch.float32).eps * o.abs().max().item()
        torch.testing.assert_close(w.double(), o, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("rope", [apply_rope, apply_rope_inplace], ids=["out_of_place", "in_place"])
def test_backward_leaves_a_shared_incoming_gradient_alone(rope):
    """``qo + other``'s backward hands one gradient tensor to RoPE's backward and to ``other``:
    RoPE's backward must not rotate it in place (as Liger's writes dq and dk into it), so
    ``other`` gets exactly that gradient and the gradient itself is unchanged."""
    x, wq, wk = _projection_leaves()
    cos, sin = _asymmetric_tables()
    q = (x @ wq).view(_B, _S, _H, _D)
    k = (x @ wk).view(_B, _S, _HK, _D)
    other = torch.zeros(_B, _S, _H, _D, device=DEV, requires_grad=True)
    qo, ko = rope(q, k, cos=cos, sin=sin)
    g = torch.randn(qo.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3))
    g0 = g.clone()
    torch.autograd.backward([qo + other, ko], [g, torch.ones_like(ko)])
    assert torch.equal(g, g0), "the incoming gradient was written"
    assert torch.equal(other.grad, g0)
    assert torch.count_nonzero(wq.grad) > 0 and torch.count_nonzero(wk.grad) > 0


# ---- torch.compile -----------------------------------------------------------------------------
class _RopeOnly(torch.nn.Module):
    """The module's RoPE alone (out of place on q, in place on a copy of k): nothing inductor
    may reorder, so compiled and eager agree bit for bit, gradients included."""

    def forward(self, q, k, cos, sin, offset):
        q = apply_rope(q, cos=cos, sin=sin, offsets=offset)
        k = apply_rope_inplace(k.clone(), cos=cos, sin=sin, offsets=offset)
        return torch.cat([q, k], dim=2)


def _per_call_ms(fn) -> float:
    return median_us(fn) / 1e3


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_compiled_module_fullgraph_dynamic_bit_exact(grad):
    """torch.compile(fullgraph=True, dynamic=True) of RoPE + attention: no graph break, one
    compile over three sequence lengths, outputs and q/k/v gradients equal to eager's (RoPE's
    own gradients bit for bit, through a second compiled module, ``_RopeOnly``)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _Attention()
    cos, sin = rope_tables(1024, 64, device=DEV)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for s in (128, 200, 333):
        qkv = _qkv(4, s, 8, 64, device=DEV, grad=grad)
        with torch.set_grad_enabled(grad):
            want, got = model(*qkv, cos, sin, 7), compiled(*qkv, cos, sin, 7)
        assert torch.equal(want, got), (s, (want - got).abs().max().item())
        if grad:
            # The gradients pass through attention's backward, which inductor may compute in
            # another order (fp32 rounding): within a few ulps of the largest gradient. RoPE's
            # own backward is checked bit for bit below.
            dy = torch.randn_like(want)
            for a, b in zip(_grads(want, qkv, dy), _grads(got, qkv, dy)):
                atol = 8 * torch.finfo(a.dtype).eps * a.abs().max().item()
                torch.testing.assert_close(b, a, rtol=0, atol=atol)
    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]  # read before _RopeOnly adds its own graph
    if grad:
        rope_only = torch.compile(_RopeOnly(), fullgraph=True, dynamic=True)
        for s in (128, 200, 333):
            qk = _qkv(4, s, 8, 64, device=DEV, grad=True)[:2]
            want_qk, got_qk = _RopeOnly()(*qk, cos, sin, 7), rope_only(*qk, cos, sin, 7)
            assert torch.equal(want_qk, got_qk), s
            dqk = torch.randn_like(want_qk)
            for a, b in zip(_grads(want_qk, qk, dqk), _grads(got_qk, qk, dqk)):
                assert torch.equal(a, b), (s, (a - b).abs().max().item())
    mode = "training" if grad else "inference"
    _report(f"compile[{mode}]: graph breaks {breaks}, graphs compiled over 3 sequence lengths "
            f"{graphs}")
    assert breaks == 0 and graphs == 1
    qkv = _qkv(4, 333, 8, 64, device=DEV, grad=grad)

    def step(fn):
        with torch.set_grad_enabled(grad):
            out = fn(*qkv, cos, sin, 7)
            if grad:
                out.backward(torch.ones_like(out))

    _report(f"compile[{mode}]: RoPE + attention [4, 333, 8, 64] eager "
            f"{_per_call_ms(lambda: step(model)):.3f} ms, compiled "
            f"{_per_call_ms(lambda: step(compiled)):.3f} ms per call")


# ---- CUDA graphs -------------------------------------------------------------------------------
def test_cuda_graph_decode_loop():
    """Capture a decode step once (offset tensor with tables, ids with computed angles, default
    check_positions), then change inputs and positions between replays."""
    b, h, hk, d = 4, 8, 2, 64
    cos, sin = rope_tables(512, d, device=DEV)
    q = torch.zeros(b, 1, h, d, device=DEV)
    k = torch.zeros(b, 1, hk, d, device=DEV)
    q2 = torch.zeros(b, 1, h, d, device=DEV)
    offsets = torch.zeros(b, dtype=torch.int64, device=DEV)
    ids = torch.zeros(b, 1, dtype=torch.int32, device=DEV)

    def step():
        out = apply_rope(q, k, cos=cos, sin=sin, offsets=offsets)
        apply_rope_inplace(q2, positions=ids)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = step()
    for _ in range(5):
        xq, xk, xq2 = torch.randn_like(q), torch.randn_like(k), torch.randn_like(q2)
        q.copy_(xq)
        k.copy_(xk)
        q2.copy_(xq2)
        offsets.copy_(torch.randint(0, 511, (b,), device=DEV))
        ids.copy_(torch.randint(0, 100_000, (b, 1), device=DEV))
        graph.replay()
        want_q, want_k = apply_rope(xq, xk, cos=cos, sin=sin, offsets=offsets)
        want_q2 = apply_rope_inplace(xq2.clone(), positions=ids)
        torch.cuda.synchronize()
        assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)
        assert torch.equal(q2, want_q2)


# ---- Hugging Face ------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_rows", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_drop_in_matches_transformers_formula(batch_rows, dtype):
    """Against transformers' formula in float64 (cos/sin rows as LlamaRotaryEmbedding returns
    them): within one rounding of the output dtype."""
    b, s, d = 3, 40, 64
    q = torch.randn(b, s, 8, d, device=DEV, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, s, 2, d, device=DEV, dtype=dtype).transpose(1, 2)
    angle = torch.rand(batch_rows, s, d // 2, device=DEV) * 100
    emb = torch.cat([angle, angle], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = hf.apply_rotary_pos_emb(q, k, cos, sin)
    want = hf_apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    eps = torch.finfo(dtype).eps
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=eps, atol=eps)


def _llama_step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return (out.loss.detach().float(), out.logits.detach().float(),
            {n: p.grad.detach().float() for n, p in model.named_parameters()})


def _rounded_once(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' formula computed in fp32 and rounded once to q's dtype (fastrope's
    rounding), to measure what bf16 rounding of the rotation alone changes."""
    qe, ke = hf_apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float(),
                                     unsqueeze_dim)
    return qe.to(q.dtype), ke.to(k.dtype)


def _max_diffs(a, b):
    """(loss, logits, worst gradient) differences between two steps; gradients relative to the
    largest element of each."""
    grads = max(((a[2][n] - b[2][n]).abs().max() / a[2][n].abs().max().clamp_min(1e-30)).item()
                for n in a[2])
    return (a[0] - b[0]).abs().item(), (a[1] - b[1]).abs().max().item(), grads


def test_patched_llama_matches_unpatched():
    """Loss, logits and every parameter gradient of a small bf16 LlamaForCausalLM, patched and
    unpatched. The tolerance is derived, not guessed: fastrope rounds the rotation once (in
    fp32, like :func:`_rounded_once`), transformers three times (q*cos, rotate_half(q)*sin, the
    sum). So fastrope must be no further from :func:`_rounded_once` than transformers is
    (|B - C| <= |A - C|), hence no further from transformers than twice that rounding's effect
    (|B - A| <= 2 |A - C|)."""
    transformers = pytest.importorskip("transformers", reason="needs Hugging Face transformers")
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=DEV, dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (2, 256), device=DEV)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return hf.apply_rotary_pos_emb(*args, **kwargs)

    def timed():
        result = _llama_step(model, ids)
        return result, _per_call_ms(lambda: _llama_step(model, ids))

    unpatched, t_hf = timed()
    with hf.patch_llama() as patch:
        assert patch.module.apply_rotary_pos_emb.family is hf.FAMILIES["llama"]
        patched, t_fast = timed()
        with hf.Patch(patch.module, "apply_rotary_pos_emb", counted):
            _llama_step(model, ids)
        with hf.Patch(patch.module, "apply_rotary_pos_emb", _rounded_once):
            rounded_once = _llama_step(model, ids)
    assert len(calls) == config.num_hidden_layers  # the patch reached every layer
    assert not hasattr(patch.module.apply_rotary_pos_emb, "family")  # undone
    b_a, c_a, b_c = (_max_diffs(*pair) for pair in ((patched, unpatched),
                                                    (rounded_once, unpatched),
                                                    (patched, rounded_once)))
    _report(f"llama: loss unpatched {unpatched[0].item():.6f} patched {patched[0].item():.6f} "
            f"rounded-once {rounded_once[0].item():.6f}")
    for name, i in (("loss", 0), ("max logit", 1), ("worst relative grad", 2)):
        _report(f"llama: {name} difference: patched-unpatched {b_a[i]:.3g}, "
                f"rounded-once-unpatched {c_a[i]:.3g}, patched-rounded-once {b_c[i]:.3g}")
    _report(f"llama: train step (fwd+bwd, [2, 256], bf16) unpatched {t_hf:.3f} ms, patched "
            f"{t_fast:.3f} ms")
    for i in range(3):
        assert b_c[i] <= c_a[i] and b_a[i] <= 2 * c_a[i], (i, b_a, c_a, b_c)
