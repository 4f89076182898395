"""The fused QK-norm + RoPE in transformers on CPU (ports/fastrope/hf_qknorm.py).

Tiny random models (hidden 64, 2 layers, 4 heads, 2 kv heads) of the fused families:
- patched with ``fuse_qk_norm=True`` on CPU gives the unpatched logits exactly (the fallback is
  the layer's own norms and rotary function);
- with the kernel's device check widened to CPU, the real ``qk_norm_rope`` runs (under
  TRITON_INTERPRET=1, set by conftest) inside the model: fp32 logits and every gradient of a
  training step agree with the unpatched model's to fp32 rounding, and the kernel ran once per
  layer with the family's norm (Gemma3: ``1 + w``);
- per-sequence cos/sin rows (a batch of position ids) reach the kernel as stacked rows;
- OLMo2 (norm over all heads) and families without the pair are refused with the reason; a
  row the installed attention contradicts is refused and nothing stays replaced; ``undo``
  restores both the rotary function and the attention's forward.

Skipped with a reason when transformers is not installed (``pip install -e '.[hf]'``) or
when neither a GPU nor the Triton interpreter is there.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs Hugging Face transformers: pip install -e '.[hf]'")

from ports import _triton  # noqa: E402
from ports.fastrope import hf, hf_models, hf_qknorm  # noqa: E402

FUSED = sorted(hf_qknorm.FUSED)
needs_kernel = pytest.mark.skipif(
    not _triton.interpreting(),
    reason="the Triton kernel on CPU tensors needs TRITON_INTERPRET=1 (conftest sets it where "
           "there is no GPU); tests/test_gpu_hf.py runs the fused kernel on the GPU")

# fp32 logits: transformers rounds after the norm and after the rotation, the kernel once;
# 2 layers keep the difference within a few hundred fp32 ulps of logits of magnitude ~1.
LOGIT_TOL = dict(rtol=1e-4, atol=1e-4)
# fp32 gradients, relative to each parameter's largest: the same roundings, through backward.
GRAD_TOL = 1e-4


def _ids(seed=1, b=2, s=16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, hf_models.TINY.vocab, (b, s), generator=gen)


def _model(name):
    """A tiny model whose norm weights are random (the defaults, ones or zeros, would hide a
    weight read wrongly)."""
    model = hf_models.model(name)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (0 if "gemma" in name else 1))
    return model


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


@pytest.fixture
def counted(monkeypatch):
    """The kernel served on CPU tensors, its calls counted with their ``gemma`` flag."""
    calls = []
    real = hf_qknorm.qk_norm_rope

    def qk_norm_rope(*args, **kwargs):
        calls.append(kwargs["gemma"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "_on_kernel_device", lambda t: True)
    monkeypatch.setattr(hf_qknorm, "qk_norm_rope", qk_norm_rope)
    return calls


@pytest.mark.parametrize("name", FUSED)
def test_fused_patch_on_cpu_is_the_original(name):
    model = _model(name)
    ids = _ids()
    want = _logits(model, ids)
    with hf.patch(model, fuse_qk_norm=True) as patch:
        assert [p.name for p in patch.parts] == ["apply_rotary_pos_emb", "forward"]
        got = _logits(model, ids)
    assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("name", FUSED)
def test_fused_kernel_inside_the_model_matches_unpatched(counted, name):
    model = _model(name)
    ids = _ids()
    want = _logits(model, ids)
    with hf.patch(name, fuse_qk_norm=True):
        got = _logits(model, ids)
    layers = hf_models.TINY.layers
    assert counted == [hf_qknorm.FUSED[name].gemma] * layers
    torch.testing.assert_close(got, want, **LOGIT_TOL)


@needs_kernel
def test_fused_kernel_per_sequence_rows(counted):
    """Position ids that differ per sequence: HF's cos/sin come [b, s, d], stacked as rows."""
    model = _model("qwen3")
    ids = _ids(b=2, s=8)
    positions = torch.stack([torch.arange(8), torch.arange(5, 13)])
    want = _logits(model, ids, position_ids=positions)
    with hf.patch(model, fuse_qk_norm=True):
        got = _logits(model, ids, position_ids=positions)
    assert counted
    torch.testing.assert_close(got, want, **LOGIT_TOL)


def test_per_sequence_rows_fold_the_batch_or_name_each_tokens_row():
    """The projections fold into one sequence of b * s tokens, token t reading row t (no
    positions tensor); q and k that do not fold keep their shape, token (j, i) reading row
    j * s + i."""
    b, s, h, d = 2, 3, 4, 8
    cos, sin = torch.rand(b, s, d), torch.rand(b, s, d)
    q, k = torch.randn(b, s, h * d).view(b, s, h, d), torch.randn(b, s, 2, d)
    fq, fk, tc, ts, positions = hf_qknorm._table(q, k, cos, sin)
    assert (fq.shape, fk.shape, positions) == ((1, b * s, h, d), (1, b * s, 2, d), None)
    assert torch.equal(tc, cos.reshape(b * s, d)) and torch.equal(ts, sin.reshape(b * s, d))
    q = torch.randn(b, h, s, d).transpose(1, 2)
    fq, fk, _, _, positions = hf_qknorm._table(q, k, cos, sin)
    assert fq is q and fk is k
    assert torch.equal(positions, torch.arange(b * s, dtype=torch.int32).view(b, s))


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}


@needs_kernel
@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_fused_kernel_training_step_matches_unpatched(counted, name):
    """Loss and every gradient, the norm weights' included (the kernel's backward)."""
    model = _model(name).train()
    ids = _ids(seed=2, b=1, s=8)
    want_loss, want = _step(model, ids)
    with hf.patch(model, fuse_qk_norm=True):
        got_loss, got = _step(model, ids)
    assert len(counted) == hf_models.TINY.layers
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    assert any(n.endswith("q_norm.weight") for n in got)
    for n in want:
        scale = want[n].abs().max().clamp_min(1e-30)
        assert ((got[n] - want[n]).abs().max() / scale).item() <= GRAD_TOL, n


def test_families_the_kernel_cannot_normalise_are_refused():
    module = hf.module_of(hf.FAMILIES["olmo2"])
    before = module.apply_rotary_pos_emb
    with pytest.raises(NotImplementedError, match="OLMo2 normalises q and k over all heads"):
        hf.patch("olmo2", fuse_qk_norm=True)
    assert module.apply_rotary_pos_emb is before
    with pytest.raises(NotImplementedError, match="llama has no per-head q_norm/k_norm"):
        hf.patch("llama", fuse_qk_norm=True)
    with pytest.raises(TypeError, match="fuse_qk_norm must be a bool"):
        hf.patch("qwen3", fuse_qk_norm="yes")


@pytest.mark.parametrize("name,wrong", [
    ("gemma3", hf_qknorm.FusedNorm("Gemma3Attention", "eps", "gemma3_text", gemma=False)),
    ("qwen3", hf_qknorm.FusedNorm("Qwen3Attention", "variance_epsilon", "qwen3", gemma=True)),
    ("qwen3", hf_qknorm.FusedNorm("Qwen3Attention", "eps", "qwen3")),
    ("qwen3_moe", hf_qknorm.FusedNorm("Qwen3MoeSparseAttention", "variance_epsilon",
                                      "qwen3_moe")),
])
def test_a_norm_row_the_installed_attention_contradicts_is_refused(monkeypatch, name, wrong):
    row = hf.FAMILIES[name]
    module = hf.module_of(row)
    cls = getattr(module, hf_qknorm.FUSED[name].attention)
    before = module.apply_rotary_pos_emb, cls.forward
    monkeypatch.setitem(hf_qknorm.FUSED, name, wrong)
    with pytest.raises(NotImplementedError, match=f"modeling_{name}.* is not fused|no class"):
        hf.patch(name, fuse_qk_norm=True)
    assert (module.apply_rotary_pos_emb, cls.forward) == before


def test_undo_restores_the_function_and_the_forward():
    row = hf.FAMILIES["qwen3"]
    module = hf.module_of(row)
    before = module.apply_rotary_pos_emb, module.Qwen3Attention.forward
    patch = hf.patch("qwen3", fuse_qk_norm=True)
    assert module.Qwen3Attention.forward.family is row
    inner = hf.patch("qwen3", fuse_qk_norm=True)  # twice: wraps the originals, not the patch
    assert module.Qwen3Attention.forward.original is before[1]
    inner.undo()
    patch.undo()
    assert (module.apply_rotary_pos_emb, module.Qwen3Attention.forward) == before
