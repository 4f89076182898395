"""A drop-in for Hugging Face transformers' ``apply_rotary_pos_emb`` (the Llama family's), and a
one-call patch that makes Llama models use it.

transformers rotates q and k ``[b, h, s, d]`` (views of ``[b, s, h, d]`` projections after
``.transpose(1, 2)``) with ``cos``/``sin`` ``[b or 1, s, d]`` from its rotary-embedding module:
one row per token, in the rotate-half convention (the two halves of each row equal). Here those
rows become fastrope's table: ``[s, d]`` when they are shared by the batch, else ``[b * s, d]``
with sequence j starting at row ``j * s`` (an offsets tensor). The outputs are fastrope's: new
contiguous tensors, rotated in fp32 and rounded once (transformers rounds each product and the
sum to q's dtype).

transformers stays optional: nothing here imports it until :func:`patch_llama` is called.
"""
from __future__ import annotations

import importlib

import torch

from ports.fastrope.api import apply_rope

LLAMA_MODULE = "transformers.models.llama.modeling_llama"


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' ``apply_rotary_pos_emb``: ``(q_embed, k_embed)``.

    q ``[b, hq, s, d]`` and k ``[b, hk, s, d]`` (``unsqueeze_dim=2``: ``[b, s, h, d]``); cos and
    sin ``[b or 1, s, d]``. ``position_ids`` is ignored, as in transformers (cos and sin already
    hold each token's row).
    """
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be a tensor or None (it is ignored), got "
                        f"{type(position_ids).__name__}; pass unsqueeze_dim by keyword")
    layouts = {1: "bhsd", 2: "bshd"}
    if unsqueeze_dim not in layouts:
        raise ValueError(f"unsqueeze_dim must be 1 (q, k [b, h, s, d]) or 2 ([b, s, h, d]), got "
                         f"{unsqueeze_dim!r}")
    layout = layouts[unsqueeze_dim]
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D, got shape {tuple(q.shape)}")
    b, s, d = q.shape[0], q.shape[3 - unsqueeze_dim], q.shape[3]
    if cos.dim() != 3 or cos.shape[0] not in (1, b) or tuple(cos.shape[1:]) != (s, d):
        raise ValueError(f"cos must be [b={b} or 1, s={s}, d={d}] for q {tuple(q.shape)} "
                         f"(unsqueeze_dim={unsqueeze_dim}), got {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin {tuple(sin.shape)} must match cos {tuple(cos.shape)}")
    offsets = None
    if cos.shape[0] == 1:  # rows shared by the batch: token i reads row i
        cos, sin = cos[0], sin[0]
    else:  # sequence j's rows start at j * s
        cos, sin = cos.reshape(b * s, d), sin.reshape(b * s, d)
        offsets = torch.arange(0, b * s, s, device=q.device, dtype=torch.int32)
    # The rows cover every token by construction: no position check (and no device sync).
    return apply_rope(q, k, cos=cos, sin=sin, offsets=offsets, layout=layout,
                      check_positions=False)


class Patch:
    """Module attributes replaced until :meth:`undo` (also a context manager)."""

    def __init__(self, module, name: str, replacement):
        self.module, self.name = module, name
        self.original = getattr(module, name)
        setattr(module, name, replacement)

    def undo(self) -> None:
        setattr(self.module, self.name, self.original)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def patch_llama() -> Patch:
    """Make transformers' Llama models rotate with fastrope: replaces
    ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb`` (which Llama's attention
    calls) until ``undo()``, or for a ``with`` block."""
    try:
        module = importlib.import_module(LLAMA_MODULE)
    except ImportError as exc:
        raise ImportError("patch_llama needs Hugging Face transformers: pip install "
                          "transformers") from exc
    return Patch(module, "apply_rotary_pos_emb", apply_rotary_pos_emb)
