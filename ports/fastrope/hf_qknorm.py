"""The fused QK-norm + RoPE in Hugging Face transformers: Qwen3, Qwen3-MoE and Gemma3 attention
normalise q and k with :func:`ports.fastrope.qknorm.qk_norm_rope`, one launch for the
``q_norm``/``k_norm`` + rotary pair.

These families' attention computes, per layer::

    q = q_norm(q_proj(x).view(b, s, h, d))      # an RMSNorm over each head's d channels
    k = k_norm(k_proj(x).view(b, s, hk, d))
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)

The norm and the rotation are two separate steps inside the attention's ``forward``, so the
fusion replaces that ``forward`` (for the attention class, until ``undo()``) with
:func:`fused_forward`: the same projections, cache update, attention interface and output
projection, with the pair in between done by ``qk_norm_rope`` on the ``[b, s, h, d]``
projections (layout ``bshd``). The norm is the kernel's: fp32 from load to store,
``x * rsqrt(mean(x^2) + eps) * w`` (Gemma3: ``* (1 + w)``), then the rotation, rounded once;
transformers rounds after the norm and after the rotation (see :mod:`ports.fastrope.qknorm`),
so in fp32 the two agree to a few ulps and in bf16 fastrope is the closer to float64.

Calls the kernel does not serve (the rotary drop-in's rules, ``hf.served``: CPU tensors,
other dtypes, ...; or norm weights not ``[head_dim]`` in a kernel dtype on q's device) run the
family's own ``q_norm``, ``k_norm`` and the module's current ``apply_rotary_pos_emb``.

Each family's row (:data:`FUSED`) names its attention class, the norm's epsilon attribute, its
config's model type and whether the norm is Gemma's. :func:`ports.fastrope.hf.patch` (with
``fuse_qk_norm=True``) builds the replacement from these pieces; this module imports nothing
of ``hf``. Before patching, :func:`probe` runs the installed class's own
``forward`` and :func:`fused_forward` on a tiny float64 layer on CPU, the fused pair replaced by
the float64 oracle of what the row declares (``reference.qk_norm``), with random norm weights:
a transformers release whose attention or norm differs from the row is refused, never served
wrong. OLMo2 normalises q and k over all heads at once (weights of ``heads * head_dim``), which
the per-head kernel does not compute: refused with that reason.

``kernels.kernelize`` cannot install the fusion: transformers 5.17 exposes the norm (layer name
``RMSNorm``, every RMSNorm of the model) and the rotation (``rotary_pos_emb``) to it as two
separate layers, each replaced alone, and the attention class, which holds the pair, is not a
kernel layer. The fusion is ``hf.patch``'s (``fuse_qk_norm=True``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ports.fastrope.qknorm import qk_norm_rope
from reference.oracle import apply_rope as oracle_apply_rope
from reference.qk_norm import rms_norm
from reference.tables import expand_half
from reference.vocabulary import KERNEL_TORCH_DTYPES

# The probe's layer: hidden 64, 4 heads of 16 channels, 2 kv heads; 2 sequences of 5 tokens.
PROBE_SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=128, attn_implementation="eager")


@dataclasses.dataclass(frozen=True)
class FusedNorm:
    """How one family's attention normalises q and k before the rotation.

    ``attention``: the attention class in the family's module. ``eps``: the name of the
    epsilon attribute of its ``q_norm``/``k_norm`` modules. ``model_type``: its config's
    (:func:`probe` builds one). ``gemma``: the norm multiplies by ``1 + weight``.
    """

    attention: str
    eps: str
    model_type: str
    gemma: bool = False


FUSED: dict[str, FusedNorm] = {
    "qwen3": FusedNorm("Qwen3Attention", "variance_epsilon", "qwen3"),
    "qwen3_moe": FusedNorm("Qwen3MoeAttention", "variance_epsilon", "qwen3_moe"),
    "gemma3": FusedNorm("Gemma3Attention", "eps", "gemma3_text", gemma=True),
}
"""The families whose q_norm/k_norm + rotary pair :func:`patch` fuses."""

REFUSED = {
    "olmo2": "OLMo2 normalises q and k over all heads at once (q_norm's weight has num_heads * "
             "head_dim elements); qk_norm_rope normalises each head with head_dim weights",
}


def fused_norm(name: str) -> FusedNorm:
    """Family ``name``'s norm row; refused, naming why, for a family the fusion does not
    serve."""
    if name in REFUSED:
        raise NotImplementedError(f"{name}: the fused q/k norm is not served: {REFUSED[name]}")
    spec = FUSED.get(name)
    if spec is None:
        raise NotImplementedError(
            f"{name} has no per-head q_norm/k_norm + rotary pair that fastrope fuses "
            f"(fused: {', '.join(sorted(FUSED))}); patch it without fuse_qk_norm for the "
            f"rotary alone")
    return spec


# ---- the pair ----------------------------------------------------------------------------------
def _weights_served(q: torch.Tensor, *weights: torch.Tensor) -> bool:
    d = q.shape[-1]
    return all(isinstance(w, torch.Tensor) and w.dtype in KERNEL_TORCH_DTYPES
               and tuple(w.shape) == (d,) and w.device == q.device for w in weights)


def fold_batch(*xs: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """``[b, s, h, d]`` tensors as ``[1, b * s, h, d]`` views of the same memory where each is
    one run of tokens at one stride (a projection's output; any tensor with b or s of 1), else
    None. Token (j, i) is then token ``j * s + i``: with each sequence's rows stacked
    ``[b * s, R]`` it reads its own row from its token index, with no positions tensor to make
    (a launch) or to read before the row (a dependent load)."""
    if all(x.shape[0] == 1 or x.shape[1] == 1 or x.stride(0) == x.shape[1] * x.stride(1)
           for x in xs):
        return tuple(x.view(1, x.shape[0] * x.shape[1], *x.shape[2:]) for x in xs)
    return None


def _table(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF's per-token rows ``[b or 1, s, R]`` for q and k ``[b, s, h, d]`` as qk_norm_rope's
    ``(q, k, cos, sin, positions)``: the shared rows as the table itself (token i reads row i),
    or every sequence's rows stacked ``[b * s, R]``, read by q and k folded into one sequence
    (:func:`fold_batch`) or else with token (j, i) at row ``j * s + i``."""
    if cos.shape[0] == 1:
        return q, k, cos[0], sin[0], None
    b, s, width = cos.shape
    cos, sin = cos.reshape(b * s, width), sin.reshape(b * s, width)
    folded = fold_batch(q, k)
    if folded is not None:
        return *folded, cos, sin, None
    positions = torch.arange(b * s, device=q.device, dtype=torch.int32).view(b, s)
    return q, k, cos, sin, positions


def norm_rope(style: str, spec: FusedNorm, module, served: Callable) -> Callable:
    """``pair(attn, q, k, cos, sin) -> (q, k)``: q ``[b, s, h, d]`` and k ``[b, s, hk, d]``
    (the projections' views) in, normalised and rotated ``[b, h, s, d]`` out; fused where
    ``served(q, k, cos, sin)`` (the rotary drop-in's rule) and the weights are the kernel's,
    else the layer's own norms and the module's ``apply_rotary_pos_emb``."""
    def pair(attn, q, k, cos, sin):
        q_w, k_w = attn.q_norm.weight, attn.k_norm.weight
        if served(q, k, cos, sin) and _weights_served(q, q_w, k_w):
            shapes = q.shape, k.shape
            q, k, table_cos, table_sin, positions = _table(q, k, cos, sin)
            # HF's rows cover every token by construction: no position check (no device sync).
            q, k = qk_norm_rope(q, k, q_w, k_w, float(getattr(attn.q_norm, spec.eps)),
                                cos=table_cos, sin=table_sin, positions=positions,
                                style=style, layout="bshd", gemma=spec.gemma,
                                check_positions=False)
            return q.view(shapes[0]).transpose(1, 2), k.view(shapes[1]).transpose(1, 2)
        q, k = attn.q_norm(q).transpose(1, 2), attn.k_norm(k).transpose(1, 2)
        return module.apply_rotary_pos_emb(q, k, cos, sin)
    return pair


def fused_forward(module, pair: Callable) -> Callable:
    """The attention ``forward`` of Qwen3, Qwen3-MoE and Gemma3 in transformers 5.17, with the
    q/k norm + rotary pair done by ``pair`` (:func:`norm_rope`). Everything else is theirs, in
    their order; their module's attention interface and eager attention are looked up at each
    call, as theirs are."""
    def forward(self, hidden_states, position_embeddings, attention_mask=None,
                past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = pair(self, q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention = module.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, module.eager_attention_forward)
        out, weights = attention(
            self, q, k, v, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights
    return forward


# ---- checking a row against the installed attention ---------------------------------------------
def _oracle_pair(style: str, spec: FusedNorm) -> Callable:
    """The pair as the row declares it, in float64: per-head RMSNorm, then the row's rotation."""
    def pair(attn, q, k, cos, sin):
        eps = float(getattr(attn.q_norm, spec.eps))
        out = []
        for x, w in ((q, attn.q_norm.weight), (k, attn.k_norm.weight)):
            z = rms_norm(x, w, eps, gemma=spec.gemma).transpose(1, 2)  # [b, h, s, d]
            out.append(oracle_apply_rope(z, cos[:, None], sin[:, None], style))
        return tuple(out)
    return pair


def probe(style: str, spec: FusedNorm, module, original_forward: Callable) -> str | None:
    """Why the family's attention (``original_forward``, of ``spec.attention`` in ``module``)
    does not compute what :func:`fused_forward` with ``spec`` and ``style`` does (None when it
    does): both run one tiny float64 layer on CPU, random weights (the norms' too), random
    cos/sin of the style's layout. The tolerance, 1e-5, admits transformers' norms, which
    compute in float32 whatever the input (Qwen3RMSNorm casts to it), and is far below the
    O(1) error of another norm (``w`` for ``1 + w``, over all heads) or rotation."""
    from transformers import AutoConfig

    cls = getattr(module, spec.attention, None)
    if cls is None:
        return f"{module.__name__} has no class {spec.attention}"
    try:
        config = AutoConfig.for_model(spec.model_type, **PROBE_SIZES)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            attn = cls(config, layer_idx=0).double().eval()
            for norm in (attn.q_norm, attn.k_norm):
                with torch.no_grad():
                    norm.weight.normal_()
            b, s, d = 2, 5, PROBE_SIZES["head_dim"]
            x = torch.randn(b, s, config.hidden_size, dtype=torch.float64)
            angle = torch.rand(b, s, d // 2, dtype=torch.float64) * 6
        cos, sin = expand_half(angle.cos(), style), expand_half(angle.sin(), style)
        with torch.no_grad():
            want = original_forward(attn, x, (cos, sin), None)[0]
            got = fused_forward(module, _oracle_pair(style, spec))(attn, x, (cos, sin), None)[0]
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to refuse
        return f"running {spec.attention} raised {type(exc).__name__}: {exc}"
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        return (f"{spec.attention}.forward is not the per-head {'Gemma ' if spec.gemma else ''}"
                f"RMSNorm (epsilon {spec.eps!r}) then the {style} rotation the fused "
                f"forward computes")
    return None
