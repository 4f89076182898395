"""The Hugging Face integration on CPU (ports/fastrope/hf.py, hf_kernels.py, hf_models.py).

Every family of the table, as a tiny random model (hidden 64, 2 layers, 4 heads, 2 kv heads):
- patched, on CPU, gives the unpatched logits exactly (the fallback is the original function);
- with the kernel's device check widened to CPU and fastrope's ``apply_rope`` replaced by a
  float64 emulation of it, the patched model (and the kernelized one) agrees with the unpatched
  one to fp32 rounding: the family's style, table form and rotary width reach fastrope right;
- the same through the real ``apply_rope`` and its host checks, the launch replaced by the
  float64 oracle (test_fastrope_ops.py's ``oracle_kernel``);
- the table refuses a family it does not hold, and a row the installed function contradicts.
kernelize with :func:`hf_kernels.kernel_mapping` on CPU keeps the original function (kernels
finds no CPU entry) or, with ``use_fallback=False``, raises.

Skipped with a reason when transformers (or, for kernelize, kernels) is not installed:
``pip install -e '.[hf]'``.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs Hugging Face transformers: pip install -e '.[hf]'")

from ports.fastrope import hf, hf_kernels, hf_models, hf_qknorm  # noqa: E402
from test_fastrope_ops import oracle_kernel  # noqa: E402,F401 - a fixture
from reference.oracle import apply_rope as oracle_apply_rope  # noqa: E402
from reference.tables import expand_half  # noqa: E402

# kernelize warns for every decorated layer without a mapping (SiLU, RMSNorm, ...).
pytestmark = pytest.mark.filterwarnings(r"ignore:(?s)\s*No kernel mapping found:UserWarning")

FAMILIES = sorted(hf.FAMILIES)
DECORATED = ["gemma", "gemma2", "gemma3", "granite", "llama", "mistral", "mixtral", "olmo2", "phi",
             "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"]


def _kernels():
    return pytest.importorskip("kernels", reason="needs Hugging Face kernels: pip install -e "
                                                 "'.[hf]'")


def _ids(seed=1, b=2, s=16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, hf_models.TINY.vocab, (b, s), generator=gen)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


class _Emulation:
    """fastrope's ``apply_rope`` as hf.py calls it, in float64 on CPU, counting its calls."""

    def __init__(self):
        self.calls = []
        self.geometry = []  # (q's shape, layout, offsets given) of each call

    def __call__(self, q, k, *, cos, sin, offsets, layout, style, rotary_dim, check_positions):
        assert check_positions is False and layout in ("bhsd", "bshd")
        self.calls.append((style, rotary_dim, cos.shape[-1]))
        self.geometry.append((tuple(q.shape), layout, offsets is not None))
        if cos.shape[-1] == rotary_dim // 2:  # one angle per pair
            cos, sin = expand_half(cos, style), expand_half(sin, style)
        seq = q.shape[2] if layout == "bhsd" else q.shape[1]
        rows = torch.arange(seq)[None]
        if offsets is not None:
            rows = rows + offsets.long()[:, None]
        c, s = cos.double()[rows], sin.double()[rows]  # [b or 1, s, R]
        c, s = (c[:, None], s[:, None]) if layout == "bhsd" else (c[:, :, None], s[:, :, None])
        return tuple(oracle_apply_rope(x.double(), c, s, style).to(x.dtype) for x in (q, k))


@pytest.fixture
def emulated(monkeypatch):
    """Serve CPU tensors, through the emulation."""
    emulation = _Emulation()
    monkeypatch.setattr(hf, "_on_kernel_device", lambda t: True)
    monkeypatch.setattr(hf, "apply_rope", emulation)
    return emulation


# fp32 model logits: HF rounds each product to fp32, the emulation once; 2 layers keep the
# difference within a few hundred fp32 ulps of logits of magnitude ~1.
LOGIT_TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_patched_model_on_cpu_is_the_original(name):
    model = hf_models.model(name)
    ids = _ids()
    want = _logits(model, ids)
    with hf.patch(model) as patch:
        assert patch.module.apply_rotary_pos_emb.family is hf.FAMILIES[name]
        got = _logits(model, ids)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_reaches_fastrope_with_its_convention(emulated, name):
    model = hf_models.model(name)
    ids = _ids()
    want = _logits(model, ids)
    with hf.patch(name):
        got = _logits(model, ids)
    assert emulated.calls, "the drop-in never reached fastrope"
    row = hf.FAMILIES[name]
    assert {style for style, _, _ in emulated.calls} == {row.style}
    if name in ("gpt_neox", "phi", "stablelm", "phi3", "glm", "glm4", "qwen3_next"):
        assert all(width < hf_models.TINY.dim for _, width, _ in emulated.calls)
    torch.testing.assert_close(got, want, **LOGIT_TOL)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_passes_fastrope_argument_checks(oracle_kernel, monkeypatch, name):
    """The real ``apply_rope`` (its host checks included) with the float64 oracle in place of
    the launch (test_fastrope_ops.py's fixture): what each drop-in passes is a valid call."""
    monkeypatch.setattr(hf, "_on_kernel_device", lambda t: True)
    model = hf_models.model(name)
    ids = _ids()
    want = _logits(model, ids)
    with hf.patch(name):
        got = _logits(model, ids)
    torch.testing.assert_close(got, want, **LOGIT_TOL)


def test_batch_rows_and_bshd_layout(emulated):
    """cos/sin with one row set per sequence (offsets) and q, k as [b, s, h, d]."""
    original = hf.original_of(hf.module_of(hf.FAMILIES["llama"]).apply_rotary_pos_emb)
    rotary = hf.drop_in(hf.FAMILIES["llama"], original)
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 5, 4, 8, generator=gen), torch.randn(2, 5, 2, 8, generator=gen)
    angle = torch.rand(2, 5, 4, generator=gen) * 6
    cos, sin = expand_half(angle.cos(), "rotate_half"), expand_half(angle.sin(), "rotate_half")
    got = rotary(q, k, cos, sin, unsqueeze_dim=2)
    want = original(q, k, cos, sin, unsqueeze_dim=2)
    assert len(emulated.calls) == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


B, S, H, HK, D = 3, 5, 4, 2, 8


def _heads_second(x):  # [b, h, s, d], as transformers' attention passes q and k
    return x.transpose(1, 2)


@pytest.mark.parametrize("make, seqlen, geometry", [
    # A decode step ([b, h, 1, d] views of the projections): one sequence of b tokens.
    (lambda b, s, h: _heads_second(torch.randn(b, s, h, D)), 1, ((1, B, H, D), "bshd", False)),
    # A prefill's projections: one sequence of b * s tokens.
    (lambda b, s, h: _heads_second(torch.randn(b, s, h, D)), S, ((1, B * S, H, D), "bshd", False)),
    # Tokens of a longer buffer (one run per sequence): an offsets tensor.
    (lambda b, s, h: _heads_second(torch.randn(b, s + 2, h, D)[:, :s]), S,
     ((B, S, H, D), "bshd", True)),
    # Contiguous [b, h, s, d]: rotated in that layout, through an offsets tensor.
    (lambda b, s, h: torch.randn(b, h, s, D), S, ((B, H, S, D), "bhsd", True)),
])
def test_batch_rows_fold_the_batch_into_one_sequence_where_memory_allows(emulated, make, seqlen,
                                                                         geometry):
    """cos/sin [b, s, d]: q and k whose batch folds into their tokens are rotated as one sequence
    of b * s tokens, token t reading row t (no offsets tensor); the others through offsets. The
    rows' two halves differ, so a drop-in reading one half for both would fail."""
    original = hf.original_of(hf.module_of(hf.FAMILIES["llama"]).apply_rotary_pos_emb)
    rotary = hf.drop_in(hf.FAMILIES["llama"], original)
    torch.manual_seed(7)
    q, k = make(B, seqlen, H), make(B, seqlen, HK)
    cos, sin = torch.rand(B, seqlen, D) * 2 - 1, torch.rand(B, seqlen, D) * 2 - 1
    got = rotary(q, k, cos, sin)
    want = original(q, k, cos, sin)
    assert emulated.geometry == [geometry]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_fold_batch_gives_views_or_none():
    x = torch.randn(B, S, H, D)
    folded = hf_qknorm.fold_batch(x, x[:, :1])
    assert [f.shape for f in folded] == [(1, B * S, H, D), (1, B, H, D)]
    assert all(f.data_ptr() == x.data_ptr() for f in folded)
    assert hf_qknorm.fold_batch(x, x[:, :2]) is None  # two tokens of each sequence of 5
    assert hf_qknorm.fold_batch(torch.randn(B, H, S, D).transpose(1, 2)) is None


def test_outputs_have_the_originals_strides(oracle_kernel, monkeypatch):
    """q, k as transformers' attention makes them ([b, h, s, d] views of [b, s, h, d] memory):
    the drop-in's outputs have the original's strides (that memory order), and its values; a
    contiguous [b, h, s, d] q keeps its own order."""
    monkeypatch.setattr(hf, "_on_kernel_device", lambda t: True)
    original = hf.original_of(hf.module_of(hf.FAMILIES["llama"]).apply_rotary_pos_emb)
    rotary = hf.drop_in(hf.FAMILIES["llama"], original)
    gen = torch.Generator().manual_seed(5)
    angle = torch.rand(2, 6, 4, generator=gen) * 6
    cos, sin = expand_half(angle.cos(), "rotate_half"), expand_half(angle.sin(), "rotate_half")
    for q, k in ((torch.randn(2, 6, 4, 8, generator=gen).transpose(1, 2),
                  torch.randn(2, 6, 2, 8, generator=gen).transpose(1, 2)),
                 (torch.randn(2, 4, 6, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen))):
        got, want = rotary(q, k, cos, sin), original(q, k, cos, sin)
        for g, w in zip(got, want):
            assert g.stride() == w.stride()
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change", ["dtype", "cos_dtype", "unsqueeze_dim", "partial", "3d"])
def test_calls_fastrope_does_not_serve_go_to_the_original(emulated, change):
    calls = []

    def original(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(unsqueeze_dim)
        return q, k

    rotary = hf.drop_in(hf.FAMILIES["llama"], original)
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    cos = sin = torch.randn(1, 3, 8)
    args = dict(q=q, k=k, cos=cos, sin=sin, unsqueeze_dim=1)
    args |= {"dtype": dict(q=q.double(), k=k.double(), cos=cos.double(), sin=sin.double()),
             "cos_dtype": dict(cos=cos.half(), sin=sin.half()),
             "unsqueeze_dim": dict(unsqueeze_dim=0),
             "partial": dict(cos=cos[..., :4], sin=sin[..., :4]),  # llama does not slice
             "3d": dict(q=q[0], k=k[0])}[change]
    rotary(**args)
    assert len(calls) == 1 and not emulated.calls


def test_without_a_cuda_device_nothing_is_served():
    q = torch.randn(1, 2, 3, 8)
    cos = torch.randn(1, 3, 8)
    assert not hf.served(hf.FAMILIES["llama"], q, q.clone(), cos, cos, 1)


def test_unknown_family_is_refused_with_the_table():
    with pytest.raises(NotImplementedError, match="'falcon' is not in fastrope's family table.*"
                                                  "served: cohere, gemma"):
        hf.patch("falcon")
    with pytest.raises(NotImplementedError, match="not a transformers model class"):
        hf.patch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="named by a string"):
        hf.family(3)


@pytest.mark.parametrize("name,wrong", [
    ("llama", hf.Family("llama", "interleaved")),
    ("cohere", hf.Family("cohere", "rotate_half")),
    ("glm", hf.Family("glm", "interleaved", table="natural", slices=True)),
    ("gpt_neox", hf.Family("gpt_neox", "interleaved", table="glm", slices=True)),
    ("llama", hf.Family("llama", "rotate_half", slices=True)),
])
def test_a_row_the_installed_function_contradicts_is_refused(monkeypatch, name, wrong):
    module = hf.module_of(hf.FAMILIES[name])
    before = module.apply_rotary_pos_emb
    monkeypatch.setitem(hf.FAMILIES, name, wrong)
    with pytest.raises(NotImplementedError, match=f"modeling_{name}.apply_rotary_pos_emb is not "
                                                  "served"):
        hf.patch(name)
    assert module.apply_rotary_pos_emb is before


def test_patch_undo_restores_and_patch_llama_is_an_alias():
    module = hf.module_of(hf.FAMILIES["llama"])
    before = module.apply_rotary_pos_emb
    patch = hf.patch_llama()
    assert module.apply_rotary_pos_emb.family is hf.FAMILIES["llama"]
    inner = hf.patch("llama")  # patching twice wraps the original, not the drop-in
    assert module.apply_rotary_pos_emb.original is before
    inner.undo()
    patch.undo()
    assert module.apply_rotary_pos_emb is before


def test_family_of_a_model_class_and_gemma3_text():
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM

    assert hf.family_of(LlamaForCausalLM) is hf.FAMILIES["llama"]
    assert hf.family_of(Gemma3ForCausalLM) is hf.FAMILIES["gemma3"]
    assert hf.family_of("glm4").table == "glm"


# ---- kernels -----------------------------------------------------------------------------------
def test_kernel_mapping_covers_cuda_in_every_mode():
    kernels = _kernels()
    mapping = hf_kernels.kernel_mapping()
    (device, modes), = mapping["rotary_pos_emb"].items()
    assert device.type == "cuda" and device.properties.min_capability == 80
    Mode = kernels.Mode
    assert set(modes) == {Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE,
                          Mode.INFERENCE | Mode.TORCH_COMPILE}
    assert modes[Mode.TRAINING].load() is hf_kernels.FastropeRotary


def test_kernelize_on_cpu_keeps_the_original_or_refuses():
    kernels = _kernels()
    model = hf_models.model("llama")
    ids = _ids()
    want = _logits(model, ids)
    with kernels.use_kernel_mapping(hf_kernels.kernel_mapping(), inherit_mapping=False):
        kernels.kernelize(model, device="cpu", mode=kernels.Mode.INFERENCE)
        assert torch.equal(_logits(model, ids), want)
        with pytest.raises(ValueError, match="No layer mapping for `rotary_pos_emb` with device "
                                             "type"):
            kernels.kernelize(model, device="cpu", mode=kernels.Mode.INFERENCE,
                              use_fallback=False)


@pytest.fixture
def cpu_mapping():
    """kernel_mapping()'s repository registered for CPU too, so kernelize installs the layer
    here; the family's function is put back afterwards."""
    kernels = _kernels()
    repo = hf_kernels.FastropeRepository()
    Mode = kernels.Mode
    modes = {Mode.TRAINING: repo, Mode.INFERENCE: repo,
             Mode.INFERENCE | Mode.TORCH_COMPILE: repo, Mode.TRAINING | Mode.TORCH_COMPILE: repo}
    yield {"rotary_pos_emb": {"cpu": modes}}
    for name in DECORATED:
        fn = hf.module_of(hf.FAMILIES[name]).apply_rotary_pos_emb
        fn.__dict__.pop("forward", None)


@pytest.mark.parametrize("name", DECORATED)
def test_kernelized_model_reaches_fastrope(emulated, cpu_mapping, name):
    kernels = _kernels()
    model = hf_models.model(name)
    ids = _ids()
    want = _logits(model, ids)
    with kernels.use_kernel_mapping(cpu_mapping, inherit_mapping=False):
        kernels.kernelize(model, device="cpu", mode=kernels.Mode.INFERENCE)
    fn = hf.module_of(hf.FAMILIES[name]).apply_rotary_pos_emb
    assert fn.forward.__func__ is hf_kernels.FastropeRotary.forward
    got = _logits(model, ids)
    assert emulated.calls
    torch.testing.assert_close(got, want, **LOGIT_TOL)


def test_kernelized_model_compiles_whole_and_falls_back_on_cpu(cpu_mapping):
    kernels = _kernels()
    model = hf_models.model("qwen3")
    ids = _ids()
    want = _logits(model, ids)
    with kernels.use_kernel_mapping(cpu_mapping, inherit_mapping=False):
        kernels.kernelize(model, device="cpu",
                          mode=kernels.Mode.INFERENCE | kernels.Mode.TORCH_COMPILE)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    assert torch.equal(_logits(compiled, ids), want)


def test_kernels_import_needs_neither_sigstore_nor_tomlkit():
    """The GPU machine gets kernels without its signing and lockfile dependencies: importing it,
    building the mapping and kernelizing a model with fastrope's repository must not touch
    them."""
    import subprocess
    import sys

    _kernels()
    code = ("import sys; sys.modules['sigstore'] = None; sys.modules['tomlkit'] = None\n"
            "import kernels, torch\n"
            "from ports.fastrope import hf_kernels, hf_models\n"
            "hf_kernels.kernel_mapping()\n"
            "repo = hf_kernels.FastropeRepository()\n"
            "model = hf_models.model('llama')\n"
            "with kernels.use_kernel_mapping({'rotary_pos_emb': {'cpu': repo}}):\n"
            "    kernels.kernelize(model, device='cpu', mode=kernels.Mode.TRAINING)\n"
            "model(torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name,served", [("llama", False), ("olmo2", True), ("cohere", True)])
def test_float32_tables_with_bf16_q_only_where_the_family_casts(name, served, monkeypatch):
    """Llama's function would return float32 (promotion): left to it. OLMo2's and Cohere's
    return q's dtype: served, fastrope reading the float32 tables."""
    monkeypatch.setattr(hf, "_on_kernel_device", lambda t: True)
    q, k = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16), torch.randn(1, 1, 3, 8,
                                                                      dtype=torch.bfloat16)
    cos = torch.randn(1, 3, 8)
    assert hf.served(hf.FAMILIES[name], q, k, cos, cos.clone(), 1) is served
