"""fastrope in transformers on the GPU: every family of the table, patched and kernelized.

Tiny random models (ports/fastrope/hf_models.py: hidden 64, 2 layers, 4 heads, 2 kv heads).

* fp32 greedy generation (prompt 2x16, 16 new tokens): patched gives the unpatched tokens, and
  fastrope ran (its calls are counted); the same through ``kernels.kernelize`` with
  :func:`hf_kernels.kernel_mapping` for every family transformers decorates.
* bf16 training step: loss, logits and every gradient, patched against unpatched. The tolerance
  is derived as in tests/test_gpu_fastrope_torch.py: fastrope rotates in fp32 and rounds once,
  transformers (most families) rounds each product and the sum. Against C, the family's own
  function run in fp32 and rounded once, fastrope (B) must be no further from transformers (A)
  than twice C's distance, |B - A| <= 2 |A - C|, with a floor of one bf16 rounding of the
  compared quantity for the families that already compute in fp32 (Cohere: A = C).
* ``generate`` with HF's static cache, compiled by transformers with
  ``CompileConfig(fullgraph=True)`` (mode reduce-overhead: CUDA graphs) over the patched model:
  the unpatched eager tokens, and fastrope traced into the graph.

* The fused QK-norm + RoPE (``patch(..., fuse_qk_norm=True)``) for Qwen3, Qwen3-MoE and Gemma3,
  with random norm weights: fp32 greedy tokens identical to unpatched; a bf16 training step
  within the same derived tolerance (C: the family's own norms and rotation in fp32, rounded
  once); ``torch.compile(fullgraph=True)`` of the fused training step.

Skipped with a reason without transformers (and, for kernelize, kernels). Estimated at about 1.5
minutes on an H100 (not yet run there), most of it the two compiles (the decode step with CUDA
graphs, the training step); the slow-marked glm4 compiled decode adds about half a minute, the
fused QK-norm tests about as much (one more compiled training step, Triton's first compiles).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs Hugging Face transformers: pip install -e '.[hf]'")

from ports.fastrope import hf, hf_kernels, hf_models  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings(r"ignore:(?s)\s*No kernel mapping found:UserWarning")]

DEV = torch.device("cuda")
FAMILIES = sorted(hf.FAMILIES)
DECORATED = ["gemma", "gemma2", "gemma3", "granite", "llama", "mistral", "mixtral", "olmo2", "phi",
             "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"]
NEW_TOKENS = 16


def _report(*parts) -> None:
    print("REPORT", *parts, flush=True)


@pytest.fixture
def counted(monkeypatch):
    """fastrope's calls from the drop-ins, counted."""
    calls = []
    real = hf.apply_rope

    def apply_rope(*args, **kwargs):
        calls.append(kwargs["style"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "apply_rope", apply_rope)
    return calls


def _prompt(seed=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randint(3, hf_models.TINY.vocab, (2, 16), device=DEV, generator=gen)


def _greedy(model, ids, **kwargs):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kwargs)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("name", FAMILIES)
def test_fp32_greedy_tokens_match_unpatched(counted, name):
    model = hf_models.model(name, device=DEV)
    ids = _prompt()
    want = _greedy(model, ids)
    with hf.patch(model):
        got = _greedy(model, ids)
    assert counted and set(counted) == {hf.FAMILIES[name].style}
    assert torch.equal(got, want)


@pytest.fixture
def kernelized():
    """Kernelize with fastrope's mapping; put every family's function back afterwards."""
    kernels = pytest.importorskip("kernels", reason="needs Hugging Face kernels: pip install -e "
                                                    "'.[hf]'")

    def kernelize(model, mode):
        with kernels.use_kernel_mapping(hf_kernels.kernel_mapping()):
            return kernels.kernelize(model, device="cuda", mode=mode)

    yield kernels, kernelize
    for name in DECORATED:
        hf.module_of(hf.FAMILIES[name]).apply_rotary_pos_emb.__dict__.pop("forward", None)


@pytest.mark.parametrize("name", DECORATED)
def test_kernelized_fp32_greedy_tokens_match_unpatched(counted, kernelized, name):
    kernels, kernelize = kernelized
    model = hf_models.model(name, device=DEV)
    ids = _prompt()
    want = _greedy(model, ids)
    kernelize(model, kernels.Mode.INFERENCE)
    got = _greedy(model, ids)
    assert counted
    assert torch.equal(got, want)


# ---- bf16 training ------------------------------------------------------------------------------
def _step(model, ids):
    """(loss, logits, {name: grad}) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().float().clone()
             for n, p in model.named_parameters() if p.grad is not None}  # compiled: _orig_mod.
    return out.loss.detach().float(), out.logits.detach().float(), grads


def _diffs(a, b):
    """(loss, max logit, worst gradient relative to its largest element) differences."""
    grads = max(((a[2][n] - b[2][n]).abs().max() / a[2][n].abs().max().clamp_min(1e-30)).item()
                for n in a[2])
    return (a[0] - b[0]).abs().item(), (a[1] - b[1]).abs().max().item(), grads


def _rounded_once(original):
    def rotary(q, k, cos, sin, unsqueeze_dim=1):
        out = original(q.float(), k.float(), cos.float(), sin.float(), unsqueeze_dim=unsqueeze_dim)
        return out[0].to(q.dtype), out[1].to(k.dtype)
    return rotary


BF16_ROUNDING = 2.0 ** -8  # one bf16 rounding, relative


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_training_step_within_bf16_tolerance(counted, name):
    model = hf_models.model(name, dtype=torch.bfloat16, device=DEV).train()
    for module in model.modules():  # no dropout: the three runs must see the same network
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ids = _prompt(seed=2)
    unpatched = _step(model, ids)
    with hf.patch(model) as patch:
        patched = _step(model, ids)
        original = patch.module.apply_rotary_pos_emb.original
        with hf.Patch(patch.module, "apply_rotary_pos_emb", _rounded_once(original)):
            once = _step(model, ids)
    assert counted
    b_a, c_a = _diffs(patched, unpatched), _diffs(once, unpatched)
    floors = (BF16_ROUNDING * unpatched[0].abs().item(),
              BF16_ROUNDING * unpatched[1].abs().max().item(), 2 * BF16_ROUNDING)
    _report(f"{name}: patched-unpatched (loss, logit, grad) {tuple(f'{x:.3g}' for x in b_a)}, "
            f"rounded-once-unpatched {tuple(f'{x:.3g}' for x in c_a)}")
    for i, what in enumerate(("loss", "logits", "gradients")):
        assert b_a[i] <= max(2 * c_a[i], floors[i]), (what, b_a, c_a, floors)


# ---- torch.compile and CUDA graphs --------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", pytest.param("glm4", marks=pytest.mark.slow)])
def test_compiled_static_cache_decode_matches_eager(name):
    """transformers compiles the decode step (fullgraph, reduce-overhead: CUDA graphs) over the
    patched model's static cache; its tokens are the unpatched eager ones. (No call counter here:
    a list that grows on every call makes dynamo guard on its length and recompile each step;
    the eager tests count the drop-in's calls.)"""
    model = hf_models.model(name, device=DEV)
    ids = _prompt(seed=3)
    want = _greedy(model, ids, cache_implementation="static", disable_compile=True)
    torch._dynamo.reset()
    config = transformers.CompileConfig(fullgraph=True)
    try:  # transformers' own compiled decode, unpatched, on this torch
        _greedy(model, ids, cache_implementation="static", compile_config=config)
    except torch._dynamo.exc.Unsupported as exc:
        pytest.skip(f"transformers' compiled static-cache decode fails unpatched on torch "
                    f"{torch.__version__}: {str(exc).splitlines()[0]}")
    torch._dynamo.reset()
    with hf.patch(model):
        got = _greedy(model, ids, cache_implementation="static", compile_config=config)
    torch._dynamo.reset()
    assert torch.equal(got, want)


def test_compiled_training_forward_backward_matches_eager():
    """``torch.compile(fullgraph=True)`` of a patched bf16 model's forward and backward."""
    model = hf_models.model("qwen3", dtype=torch.bfloat16, device=DEV).train()
    ids = _prompt(seed=4)
    with hf.patch(model):
        eager = _step(model, ids)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        got = _step(compiled, ids)
    torch._dynamo.reset()
    loss, logits, grads = _diffs(got, eager)
    # inductor fuses the rest of the model differently from eager: a few bf16 roundings apart
    assert loss <= 4 * BF16_ROUNDING * eager[0].abs().item()
    assert logits <= 8 * BF16_ROUNDING * eager[1].abs().max().item()
    assert grads <= 8 * 2 * BF16_ROUNDING


# ---- the fused QK-norm + RoPE (patch(..., fuse_qk_norm=True)) ----------------------------------
FUSED = ["gemma3", "qwen3", "qwen3_moe"]


@pytest.fixture
def fused_calls(monkeypatch):
    """qk_norm_rope's calls from the fused attention, counted."""
    from ports.fastrope import hf_qknorm

    calls = []
    real = hf_qknorm.qk_norm_rope

    def qk_norm_rope(*args, **kwargs):
        calls.append(kwargs["gemma"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_qknorm, "qk_norm_rope", qk_norm_rope)
    return calls


def _random_norms(model, name, seed=7):
    """Random q_norm/k_norm weights (the defaults, ones or zeros, would hide a weight misread)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                noise = torch.randn(p.shape, device=DEV, generator=gen, dtype=torch.float32)
                p.copy_(noise * 0.5 + (0.0 if name == "gemma3" else 1.0))
    return model


@pytest.mark.parametrize("name", FUSED)
def test_fused_qk_norm_fp32_greedy_tokens_match_unpatched(fused_calls, name):
    from ports.fastrope.hf_qknorm import FUSED as ROWS

    model = _random_norms(hf_models.model(name, device=DEV), name)
    ids = _prompt()
    want = _greedy(model, ids)
    with hf.patch(model, fuse_qk_norm=True):
        got = _greedy(model, ids)
    assert fused_calls and set(fused_calls) == {ROWS[name].gemma}
    assert torch.equal(got, want)


def _norm_rope_rounded_once(attn, q, k, cos, sin, *, module):
    """C for the fused pair: the layer's own norms and rotary function run in fp32, rounded once
    to the model's dtype (what the fused kernel computes, by transformers' own code)."""
    from torch.func import functional_call

    dtype = q.dtype
    qf, kf = (functional_call(norm, {"weight": norm.weight.float()}, (x.float(),)).transpose(1, 2)
              for norm, x in ((attn.q_norm, q), (attn.k_norm, k)))
    q, k = module.apply_rotary_pos_emb(qf, kf, cos.float(), sin.float())
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize("name", FUSED)
def test_fused_qk_norm_bf16_training_step_within_bf16_tolerance(fused_calls, name):
    """As test_bf16_training_step_within_bf16_tolerance, for the fused pair: B = fused, A =
    unpatched, C = the family's own norms and rotation in fp32 rounded once; |B - A| <= 2 |A - C|
    with the floor of one bf16 rounding."""
    import functools

    from ports.fastrope import hf_qknorm

    model = _random_norms(hf_models.model(name, dtype=torch.bfloat16, device=DEV), name).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ids = _prompt(seed=2)
    unpatched = _step(model, ids)
    row, spec = hf.FAMILIES[name], hf_qknorm.FUSED[name]
    module = hf.module_of(row)
    cls = getattr(module, spec.attention)
    with hf.patch(model, fuse_qk_norm=True):
        fused = _step(model, ids)
    once_forward = hf_qknorm.fused_forward(
        module, functools.partial(_norm_rope_rounded_once, module=module))
    with hf.Patch(cls, "forward", once_forward):
        once = _step(model, ids)
    assert fused_calls
    b_a, c_a = _diffs(fused, unpatched), _diffs(once, unpatched)
    floors = (BF16_ROUNDING * unpatched[0].abs().item(),
              BF16_ROUNDING * unpatched[1].abs().max().item(), 2 * BF16_ROUNDING)
    _report(f"{name} fused qk-norm: fused-unpatched (loss, logit, grad) "
            f"{tuple(f'{x:.3g}' for x in b_a)}, rounded-once-unpatched "
            f"{tuple(f'{x:.3g}' for x in c_a)}")
    for i, what in enumerate(("loss", "logits", "gradients")):
        assert b_a[i] <= max(2 * c_a[i], floors[i]), (what, b_a, c_a, floors)


def test_fused_qk_norm_compiled_training_matches_eager():
    """``torch.compile(fullgraph=True)`` of a fused bf16 Qwen3's forward and backward."""
    model = _random_norms(hf_models.model("qwen3", dtype=torch.bfloat16, device=DEV),
                          "qwen3").train()
    ids = _prompt(seed=4)
    with hf.patch(model, fuse_qk_norm=True):
        eager = _step(model, ids)
        torch._dynamo.reset()
        got = _step(torch.compile(model, fullgraph=True), ids)
    torch._dynamo.reset()
    loss, logits, grads = _diffs(got, eager)
    assert loss <= 4 * BF16_ROUNDING * eager[0].abs().item()
    assert logits <= 8 * BF16_ROUNDING * eager[1].abs().max().item()
    assert grads <= 8 * 2 * BF16_ROUNDING
