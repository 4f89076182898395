"""Randomly initialised transformers models of every family in :data:`hf.FAMILIES`, from one set
of sizes: the tests' tiny models and the benchmark's 1B-class ones.

Each family's config takes the shared sizes under its own names (GPT-NeoX has no kv heads;
Gemma's default head dim is 256; the MoE families take an expert count and size; Qwen3-Next
alternates linear and full attention), and every partial-rotary family keeps its own default
fraction (GPT-NeoX 0.25, Phi 0.5, StableLM 0.25, GLM 0.5, Qwen3-Next 0.25; Phi3 is given 0.5,
its default being full width), so the partial path is what the models exercise.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A decoder's sizes; ``head_dim = hidden // heads`` unless given."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 128
    max_positions: int = 256
    head_dim: int | None = None

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


TINY = Sizes()
"""The tests' models: hidden 64, 2 layers, 4 heads, 2 kv heads."""

ONE_B = Sizes(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=32000,
              max_positions=16384 + 256, head_dim=64)
"""A 1B-class decoder: hidden 2048, 16 layers, 32/8 heads, head dim 64."""

# Per family: the config class's own keywords beyond the shared ones. The MoE families route
# every token to all 4 experts: no top-k choice that rounding could flip between two runs.
_EXTRA = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=4),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=4, shared_expert_intermediate_size=None,
                      decoder_sparse_step=1),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=4, decoder_sparse_step=1),
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=4, decoder_sparse_step=1,
                       layer_types=None, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_conv_kernel_dim=4),
    "gemma2": dict(sliding_window=8),
    "gemma3": dict(sliding_window=8),
    "phi3": dict(partial_rotary_factor=0.5),
}


def config(name: str, sizes: Sizes = TINY, *, attention: str = "eager"):
    """A transformers config of family ``name`` with ``sizes``; ``attention`` is transformers'
    ``attn_implementation`` (the tests' eager; the benchmark's sdpa)."""
    from transformers import AutoConfig

    from ports.fastrope.hf import family

    family(name)  # refuses a family not in the table
    model_type = "gemma3_text" if name == "gemma3" else name
    shared = dict(hidden_size=sizes.hidden, num_hidden_layers=sizes.layers,
                  num_attention_heads=sizes.heads, intermediate_size=sizes.intermediate,
                  vocab_size=sizes.vocab, max_position_embeddings=sizes.max_positions,
                  attn_implementation=attention, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name != "gpt_neox":
        shared["num_key_value_heads"] = sizes.kv_heads
    shared["head_dim"] = sizes.dim  # Gemma's and GLM's defaults differ from hidden / heads
    extra = dict(_EXTRA.get(name, {}))
    if "num_experts" in extra or "num_local_experts" in extra:
        extra["moe_intermediate_size"] = sizes.intermediate // 2
    if name == "qwen2_moe":
        extra["shared_expert_intermediate_size"] = sizes.intermediate // 2
    if name == "qwen3_next":
        extra["layer_types"] = ["linear_attention", "full_attention"] * (sizes.layers // 2) \
            + ["full_attention"] * (sizes.layers % 2)
        extra["linear_key_head_dim"] = extra["linear_value_head_dim"] = sizes.dim
    return AutoConfig.for_model(model_type, **shared, **extra)


def model(name: str, sizes: Sizes = TINY, *, seed: int = 0, dtype=torch.float32,
          device: str | torch.device = "cpu", attention: str = "eager"):
    """A causal LM of family ``name``, random weights from ``seed``, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(config(name, sizes, attention=attention), dtype=dtype)
    return lm.to(device).eval()
