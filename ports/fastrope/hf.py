"""fastrope in Hugging Face transformers: a drop-in for each family's ``apply_rotary_pos_emb``,
a family table, and a one-call :func:`patch`.

transformers rotates q and k ``[b, h, s, d]`` (views of ``[b, s, h, d]`` projections after
``.transpose(1, 2)``; ``unsqueeze_dim=2``: ``[b, s, h, d]``) with ``cos``/``sin``
``[b or 1, s, R]`` from the family's rotary-embedding module, one row per token. Here those rows
become fastrope's table: ``[s, .]`` when the batch shares them, else ``[b * s, .]`` with
sequence j starting at row ``j * s``, read by q and k folded into one sequence of ``b * s``
tokens where their memory allows (a decode step always; ``hf_qknorm.fold_batch``), else through
an offsets tensor. The outputs are fastrope's: new
contiguous tensors, rotated in fp32 and rounded once (transformers rounds each product and the
sum to q's dtype).

The families differ in three ways, all fixed by the family's source, so each is a row of
:data:`FAMILIES`:

========================  ==============  =====================================  ==========
families                  style           cos/sin as the model passes them       slices R
========================  ==============  =====================================  ==========
Llama and its copies      rotate-half     ``cat(f, f)`` (natural)                no
GPT-NeoX, Phi3,           rotate-half     ``cat(f, f)``                          yes
Qwen3-Next
Cohere                    interleaved     ``repeat_interleave(f, 2)`` (natural)  no
GLM, GLM4                 interleaved     ``cat(f, f)``; the function uses       yes
                                          ``f`` repeated-interleaved
========================  ==============  =====================================  ==========

"Slices R": the function itself rotates only ``q[..., :R]`` with ``R = cos.shape[-1]`` and
passes the rest through (partial rotary). Phi and StableLM are partial too, but their attention
slices q before the call, so their function sees full-width rotary. OLMo2 and Cohere return
q's dtype whatever cos's (OLMo2 passes float32 cos/sin with bf16 q), so fastrope serves them with
float32 tables too. The rotary width R is read from cos at every call; the style, the table's
form, slicing and casting come from the row. :func:`patch` checks
the row against the installed function before it patches (a float64 probe on CPU), so a
transformers release that changes a family's convention is refused, never served wrong.

Fallback: a call fastrope does not serve (tensors not on a CUDA device, dtypes other than
float32/float16/bfloat16 or q and k apart, cos/sin not in q's dtype where the family's function
would promote its outputs, shapes other than the above, an ``unsqueeze_dim`` other than 1 or 2)
runs the family's original function, so a patched model runs anywhere the unpatched one does.

transformers stays optional: nothing here imports it until :func:`patch` is called.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Literal

import torch

from ports.fastrope import hf_qknorm
from ports.fastrope.api import apply_rope
from reference.oracle import apply_rope as oracle_apply_rope
from reference.tables import expand_half

MODELS_PACKAGE = "transformers.models"
SERVED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS = {1: "bhsd", 2: "bshd"}  # unsqueeze_dim -> fastrope layout of q and k


@dataclasses.dataclass(frozen=True)
class Family:
    """How one transformers family's ``apply_rotary_pos_emb`` rotates.

    ``style``: fastrope's convention. ``table``: ``"natural"`` when cos/sin arrive in the
    style's own layout (fastrope reads them as they are), ``"glm"`` when they arrive as
    ``cat(f, f)`` and the function rotates interleaved pairs by ``f`` (fastrope reads the first
    half, one angle per pair). ``slices``: the function rotates ``q[..., :cos.shape[-1]]`` and
    passes the rest through. ``casts``: the function returns q's dtype whatever cos's (OLMo2
    takes float32 cos/sin with bf16 q, Cohere computes in float32); without it, cos/sin of
    another dtype would promote the outputs, so such a call is left to the original.
    """

    name: str
    style: Literal["rotate_half", "interleaved"]
    table: Literal["natural", "glm"] = "natural"
    slices: bool = False
    casts: bool = False

    @property
    def module(self) -> str:
        return f"{MODELS_PACKAGE}.{self.name}.modeling_{self.name}"


def _families(*rows: Family) -> dict[str, Family]:
    return {row.name: row for row in rows}


FAMILIES: dict[str, Family] = _families(
    *(Family(name, "rotate_half") for name in (
        "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
        "gemma2", "gemma3", "granite", "phi", "stablelm")),
    Family("olmo2", "rotate_half", casts=True),
    *(Family(name, "rotate_half", slices=True) for name in ("phi3", "gpt_neox", "qwen3_next")),
    Family("cohere", "interleaved", casts=True),
    Family("glm", "interleaved", table="glm", slices=True),
    Family("glm4", "interleaved", table="glm", slices=True),
)
"""The families :func:`patch` serves, by transformers' folder name (``transformers.models.X``)."""


def family(name: str) -> Family:
    """The row for ``name``; a family not in the table raises with the list of those that are."""
    if not isinstance(name, str):
        raise TypeError(f"a family is named by a string, got {type(name).__name__}")
    row = FAMILIES.get(name)
    if row is None:
        raise NotImplementedError(
            f"transformers family {name!r} is not in fastrope's family table, which says for each "
            f"family its rotary convention (rotate-half or interleaved), the form of its cos/sin "
            f"and whether it rotates a partial width; served: {', '.join(sorted(FAMILIES))}")
    return row


# ---- the call -----------------------------------------------------------------------------------
def _on_kernel_device(t: torch.Tensor) -> bool:
    """Whether fastrope's kernel can read ``t``: a CUDA tensor (the tests widen this)."""
    return t.is_cuda


def served(row: Family, q, k, cos, sin, unsqueeze_dim) -> bool:
    """Whether fastrope rotates this call; otherwise the family's original function does.

    Only shapes, dtypes, devices and strides are read (no data), so under torch.compile the
    answer is fixed at trace time.
    """
    tensors = (q, k, cos, sin)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or unsqueeze_dim not in LAYOUTS:
        return False
    if q.dtype not in SERVED_DTYPES or k.dtype != q.dtype or sin.dtype != cos.dtype:
        return False
    if cos.dtype != q.dtype and not (row.casts and cos.dtype in SERVED_DTYPES):
        return False
    if not _on_kernel_device(q) or any(t.device != q.device for t in tensors):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    seq_dim = 3 - unsqueeze_dim
    b, s, d = q.shape[0], q.shape[seq_dim], q.shape[3]
    if (k.shape[0], k.shape[seq_dim], k.shape[3]) != (b, s, d) or q.numel() == 0 \
            or k.numel() == 0:
        return False
    width = cos.shape[2]
    if cos.shape[0] not in (1, b) or cos.shape[1] != s or width % 2 or not 0 < width <= d:
        return False
    if width != d and not row.slices:
        return False  # the original broadcasts (or fails); fastrope would rotate part of q
    return all(t.stride(-1) == 1 for t in tensors)


def rotate(row: Family, q, k, cos, sin, unsqueeze_dim: int = 1):
    """fastrope's ``(q_embed, k_embed)`` for a call :func:`served` accepts."""
    b, s = q.shape[0], q.shape[3 - unsqueeze_dim]
    width = cos.shape[2]
    layout = LAYOUTS[unsqueeze_dim]
    heads_second = layout == "bhsd"
    # q and k as [b, s, h, d] views (rotated as bshd: the outputs keep that memory order)
    qs, ks = (q.transpose(1, 2), k.transpose(1, 2)) if heads_second else (q, k)
    rotated = qs, ks
    offsets = None
    if cos.shape[0] == 1:  # rows shared by the batch: token i reads row i
        cos, sin = cos[0], sin[0]
    else:  # sequence j's rows start at j * s
        cos, sin = cos.reshape(b * s, width), sin.reshape(b * s, width)
        folded = hf_qknorm.fold_batch(qs, ks)  # token j * s + i reads row j * s + i
        if folded is not None:
            rotated = folded
        else:
            offsets = torch.arange(0, b * s, s, device=q.device, dtype=torch.int32)
    if row.table == "glm":  # cat(f, f): the first half holds one angle per pair
        cos, sin = cos[:, : width // 2], sin[:, : width // 2]
    if rotated[0] is qs and heads_second and not (_token_major(q) and _token_major(k)):
        rotated, layout = (q, k), "bhsd"  # [b, h, s, d] memory: rotated as it is
    else:
        layout = "bshd"
    # The rows cover every token by construction: no position check (and no device sync).
    q_embed, k_embed = apply_rope(*rotated, cos=cos, sin=sin, offsets=offsets, layout=layout,
                                  style=row.style, rotary_dim=width, check_positions=False)
    if layout == "bhsd":
        return q_embed, k_embed
    q_embed, k_embed = q_embed.view(qs.shape), k_embed.view(ks.shape)
    return (q_embed.transpose(1, 2), k_embed.transpose(1, 2)) if heads_second \
        else (q_embed, k_embed)


def _token_major(x) -> bool:
    """Whether ``x [b, h, s, d]`` is a view of ``[b, s, h, d]`` memory (a projection's output,
    transposed, as transformers' attention makes q and k). The original's elementwise ops give
    outputs in that memory order; fastrope's outputs are contiguous in the layout it is given,
    so it is given bshd, and the drop-in's outputs have the original's strides."""
    return x.shape[2] > 1 and x.stride(1) < x.stride(2)


def drop_in(row: Family, original: Callable) -> Callable:
    """The family's ``apply_rotary_pos_emb`` through fastrope, ``original`` where not served.

    The result carries ``.original`` and ``.family``.
    """
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if served(row, q, k, cos, sin, unsqueeze_dim):
            return rotate(row, q, k, cos, sin, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb.original = original
    apply_rotary_pos_emb.family = row
    apply_rotary_pos_emb.__qualname__ = f"fastrope_{row.name}_apply_rotary_pos_emb"
    return apply_rotary_pos_emb


LLAMA = FAMILIES["llama"]


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The Llama family's ``apply_rotary_pos_emb`` through fastrope, with no fallback: a call
    fastrope cannot serve raises (:func:`patch` installs the falling-back :func:`drop_in`).

    q ``[b, hq, s, d]`` and k ``[b, hk, s, d]`` (``unsqueeze_dim=2``: ``[b, s, h, d]``); cos and
    sin ``[b or 1, s, d]``. ``position_ids`` is ignored, as in transformers 4 (cos and sin
    already hold each token's row).
    """
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be a tensor or None (it is ignored), got "
                        f"{type(position_ids).__name__}; pass unsqueeze_dim by keyword")
    if unsqueeze_dim not in LAYOUTS:
        raise ValueError(f"unsqueeze_dim must be 1 (q, k [b, h, s, d]) or 2 ([b, s, h, d]), got "
                         f"{unsqueeze_dim!r}")
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
    return rotate(LLAMA, q, k, cos, sin, unsqueeze_dim)


# ---- checking a row against the installed function ----------------------------------------------
def probe(row: Family, original: Callable) -> str | None:
    """Why ``original`` does not rotate as ``row`` says (None when it does).

    Calls it in float64 on CPU (where a drop-in falls back, so a patched function probes as its
    original) with random q, k and tables laid out as the family's rotary module builds them,
    and compares with the float64 oracle of the row's convention: full width, and for a row
    that slices, half width. The tolerance, 1e-5, admits a function that computes in float32
    (Cohere upcasts q and k) and is far below a wrong convention's O(1) error.
    """
    gen = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 2, 3, 8
    widths = (d, d // 2) if row.slices else (d,)
    for width in widths:
        q = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
        k = torch.randn(b, 1, s, d, generator=gen, dtype=torch.float64)
        angle = torch.rand(b, s, width // 2, generator=gen, dtype=torch.float64) * 6
        built = "rotate_half" if row.table == "glm" else row.style  # the module's layout
        cos, sin = expand_half(angle.cos(), built), expand_half(angle.sin(), built)
        want_cos = expand_half(angle.cos(), row.style)
        want_sin = expand_half(angle.sin(), row.style)
        try:
            got = original(q, k, cos, sin, unsqueeze_dim=1)
        except Exception as exc:  # noqa: BLE001 - any failure is a reason to refuse
            return (f"calling it as (q, k, cos, sin, unsqueeze_dim=1) with rotary width {width} "
                    f"of head dim {d} raised {type(exc).__name__}: {exc}")
        for name, x, y in (("q", q, got[0]), ("k", k, got[1])):
            want = oracle_apply_rope(x, want_cos[:, None], want_sin[:, None], row.style)
            if y.shape != want.shape or not torch.allclose(y, want, rtol=1e-5, atol=1e-5):
                return (f"its {name} output for rotary width {width} of head dim {d} is not the "
                        f"{row.style} rotation with {row.table} cos/sin the table declares")
    if row.casts:
        got = original(q.bfloat16(), k.bfloat16(), cos.float(), sin.float(), unsqueeze_dim=1)
        if any(y.dtype != torch.bfloat16 for y in got):
            return (f"it returns {got[0].dtype} for bfloat16 q and k with float32 cos/sin; the "
                    f"table says it returns q's dtype")
    return None


# ---- patching -----------------------------------------------------------------------------------
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


class Patches(Patch):
    """Several :class:`Patch` undone together, last first; ``module``, ``name`` and
    ``original`` are the first's (the rotary function's)."""

    def __init__(self, *parts: Patch):
        self.parts = parts
        self.module, self.name, self.original = parts[0].module, parts[0].name, parts[0].original

    def undo(self) -> None:
        for part in reversed(self.parts):
            part.undo()


def family_of(model_or_family) -> Family:
    """The row for a family name, a model instance or a model class (by its transformers
    module ``transformers.models.X.modeling_X``)."""
    if isinstance(model_or_family, str):
        return family(model_or_family)
    cls = model_or_family if isinstance(model_or_family, type) else type(model_or_family)
    parts = cls.__module__.split(".")
    if len(parts) != 4 or ".".join(parts[:2]) != MODELS_PACKAGE \
            or parts[3] != f"modeling_{parts[2]}":
        raise NotImplementedError(
            f"{cls.__name__} (module {cls.__module__}) is not a transformers model class from "
            f"{MODELS_PACKAGE}.X.modeling_X; pass a family name, one of "
            f"{', '.join(sorted(FAMILIES))}")
    return family(parts[2])


def module_of(row: Family):
    """The family's transformers module, imported (ImportError naming the extra without it)."""
    try:
        return importlib.import_module(row.module)
    except ImportError as exc:
        raise ImportError(f"patching needs Hugging Face transformers with {row.module}: pip "
                          f"install 'rope-ports[hf]' (or transformers)") from exc


def original_of(fn: Callable) -> Callable:
    """The function a drop-in wraps (``fn`` itself when it is not a drop-in)."""
    while getattr(fn, "family", None) is not None and hasattr(fn, "original"):
        fn = fn.original
    return fn


def patch(model_or_family, *, fuse_qk_norm: bool = False) -> Patch:
    """Make a transformers family rotate with fastrope (falling back to its own function).

    ``model_or_family``: a model, a model class, or a family name (``"llama"``, ``"glm4"``, ...;
    :data:`FAMILIES`). Replaces ``transformers.models.X.modeling_X.apply_rotary_pos_emb``,
    which every model of the family calls, until ``undo()`` or the end of a ``with`` block.
    Refused with ``NotImplementedError`` (naming what is missing) for a family not in the table,
    without a module-level ``apply_rotary_pos_emb``, or whose function does not rotate as its
    row says.

    ``fuse_qk_norm=True`` (Qwen3, Qwen3-MoE, Gemma3: :data:`.hf_qknorm.FUSED`) also replaces the
    family's attention ``forward``, so that its q_norm/k_norm and the rotation are one
    :func:`~ports.fastrope.qknorm.qk_norm_rope` launch (:mod:`ports.fastrope.hf_qknorm`);
    refused for any other family, with the reason.

    Example::

        from ports.fastrope.hf import patch
        with patch(model):          # or: p = patch("qwen3", fuse_qk_norm=True); ...; p.undo()
            model.generate(...)
    """
    if not isinstance(fuse_qk_norm, bool):
        raise TypeError(f"fuse_qk_norm must be a bool, got {type(fuse_qk_norm).__name__}")
    row = family_of(model_or_family)
    module = module_of(row)
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is None:
        raise NotImplementedError(f"{row.module} has no module-level apply_rotary_pos_emb to "
                                  f"replace (this transformers version rotates elsewhere)")
    original = original_of(current)
    reason = probe(row, original)
    if reason is not None:
        raise NotImplementedError(f"{row.module}.apply_rotary_pos_emb is not served: {reason}")
    if fuse_qk_norm:
        forward = fused_forward(row, module)
        return Patches(Patch(module, "apply_rotary_pos_emb", drop_in(row, original)),
                       Patch(getattr(module, forward.attention), "forward", forward))
    return Patch(module, "apply_rotary_pos_emb", drop_in(row, original))


def fused_forward(row: Family, module) -> Callable:
    """The attention ``forward`` that fuses the family's q/k norm with the rotation
    (:mod:`.hf_qknorm`); refused, naming why, where its row or its probe says. It carries
    ``.original``, ``.family`` and ``.attention`` (the class's name)."""
    spec = hf_qknorm.fused_norm(row.name)
    cls = getattr(module, spec.attention, None)
    if cls is None:
        raise NotImplementedError(f"{row.module} has no class {spec.attention} to fuse")
    original = original_of(cls.forward)
    reason = hf_qknorm.probe(row.style, spec, module, original)
    if reason is not None:
        raise NotImplementedError(f"{row.module}.{spec.attention} is not fused: {reason}")

    def served_here(q, k, cos, sin):  # q and k [b, s, h, d]: unsqueeze_dim 2
        return served(row, q, k, cos, sin, 2)

    forward = hf_qknorm.fused_forward(module, hf_qknorm.norm_rope(row.style, spec, module,
                                                                  served_here))
    forward.original, forward.family, forward.attention = original, row, spec.attention
    forward.__qualname__ = f"fastrope_{spec.attention}_forward"
    return forward


def patch_llama() -> Patch:
    """``patch("llama")``, the name this module's first version had."""
    try:
        return patch("llama")
    except ImportError as exc:
        raise ImportError("patch_llama needs Hugging Face transformers: pip install "
                          "transformers") from exc
