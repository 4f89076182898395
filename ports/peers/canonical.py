"""The peers as registry entries: each maps a canonical case to the library's own public API.

Every peer is imported on first use (``prepare``), so the registry loads without them. What a
peer supports is its design (``unsupported_reason``); whether it is installed here is its spec's
``missing()``: the runner marks a case it supports ``not installed: pip install X`` when the
import fails, and ``compare.py --list`` names the missing peers.

In-place peers (Liger always when its input is bshd-contiguous, vLLM always, FlashInfer's
``*_inplace``, flash-attn ``inplace=True``) run on copies made in ``prepare``: the first call is
the one validated, later timed calls rotate the same buffers again. Out-of-place peers get the
case's tensors themselves.

Tables. Where a peer takes tables, it gets the case's own (``inputs.cos``/``inputs.sin``, in the
case's cos/sin dtype), reshaped once in ``prepare`` the way a model builds its cache once:
half-width ``[L, R/2]`` for flash-attn, ``cat(cos, sin)`` ``[L, R]`` for vLLM and FlashInfer's cache
form. TE takes fp32 angles (``freqs``), the case's ideal angles rounded to fp32. FlashInfer's
``apply_rope``/``apply_rope_pos_ids`` compute angles in the kernel from ``rope_theta``.
"""
from __future__ import annotations

import functools

import torch

from ports._adapters import AutogradCall, forward_or_backward, half_width_tables
from ports.peers import NotInstalled, PeerSpec, flash_attn_rotary, import_peer
from reference.case import RopeCase, RopeInputs
from reference.tables import expand_half, first_members
from reference.tolerances import ANGLE_REL_ERR_FAST_MATH, DEFAULT_STEPS

# Peers whose arithmetic runs in the table's dtype (Liger: ``.to(sin_row.dtype)``) or that store
# the table in x's dtype (vLLM) round more often than fp32-math kernels: up to ~2.5 steps at the
# data's magnitude, as apex (ports/apex/canonical.py says why); 4 leaves margin.
LOW_PRECISION_STEPS = dict(DEFAULT_STEPS, fp16=4.0, bf16=4.0)
HALF_DTYPES = frozenset({"fp16", "bf16"})
KERNEL_DTYPES = frozenset({"fp32", "fp16", "bf16"})
DENSE = frozenset({"sbhd", "bshd", "bhsd"})
GATHERED_ROWS = "cos/sin rows gathered per token (positions offset/ids) outside the timed call"


# ---- availability ----------------------------------------------------------------------------
@functools.cache
def _available(loader) -> str | None:
    """``None`` if ``loader()`` imports the peer, else its ``not installed`` line."""
    try:
        loader()
    except NotInstalled as exc:
        return str(exc)
    return None


def _guard(loader, *more) -> dict:
    """The spec fields ``check`` (the design limits ``more``, each case -> reason or None) and
    ``missing`` (whether the peer imports here; the runner asks it after ``check``)."""
    def missing() -> str | None:
        return _available(loader)

    def check(case: RopeCase) -> str | None:
        for limit in more:
            reason = limit(case)
            if reason:
                return reason
        return None
    return dict(missing=missing, check=check)


def _needs_k(case: RopeCase) -> str | None:
    if case.kv_heads is None:
        return "rotates q and k in one call: needs a k (kv_heads)"
    if case.with_v:
        return "rotates q and k only (no v)"
    return None


def _no_v(case: RopeCase) -> str | None:
    return "rotates q and k only (no v)" if case.with_v else None


def _table_is_x_dtype(case: RopeCase) -> str | None:
    if case.table_dtype != case.torch_dtype:
        return "cos/sin must be in x's dtype (the peer takes one dtype for both)"
    return None


# ---- layout helpers --------------------------------------------------------------------------
def _bshd_view(case: RopeCase, x: torch.Tensor) -> torch.Tensor:
    """A dense x as a ``[b, s, h, d]`` view (no copy)."""
    return {"bshd": x, "sbhd": x.transpose(0, 1), "bhsd": x.transpose(1, 2)}[case.layout]


def _from_bshd(case: RopeCase, y: torch.Tensor) -> torch.Tensor:
    return {"bshd": y, "sbhd": y.transpose(0, 1), "bhsd": y.transpose(1, 2)}[case.layout]


def _token_view(case: RopeCase, x: torch.Tensor) -> torch.Tensor:
    """x as ``[tokens, h, d]`` (thd as is; bshd's ``b, s`` flattened, a view for the case's
    contiguous and qkv-cut inputs)."""
    return x if case.layout == "thd" else x.flatten(0, 1)


def _token_positions(inputs: RopeInputs) -> torch.Tensor:
    return inputs.positions.reshape(-1)


def _in_place_call(case: RopeCase, inputs: RopeInputs, rotate):
    """``rotate(buffers)`` on copies of the case's tensors made here (forward); for backward,
    autograd through ``rotate`` of copies inside the graph (as a model hands a peer the output
    of a projection, not a leaf, which autograd would not let it write), with copies of dy (an
    in-place peer's backward may rotate dy itself, as Liger's does; the runner notes it)."""
    buffers = [x.clone() for x in inputs.xs]
    if case.direction == "forward":
        return lambda: tuple(rotate(buffers))
    leaves = [b.requires_grad_(True) for b in buffers]
    grads = [g.clone() for g in inputs.grads]
    return AutogradCall(lambda ls: rotate([leaf.clone() for leaf in ls]), leaves, grads)


# ---- Liger-Kernel ----------------------------------------------------------------------------
def _liger():
    return import_peer("liger_kernel.ops.rope", "liger-kernel")


def _prepare_liger(case: RopeCase, inputs: RopeInputs):
    fn = _liger().LigerRopeFunction.apply
    s = case.seqlen
    if case.positions == "arange":
        cos, sin = inputs.cos[:s], inputs.sin[:s]            # [s, R], shared by every sequence
    else:
        cos, sin = inputs.cos[inputs.positions], inputs.sin[inputs.positions]  # [b, s, R]
    extra = () if case.rot_dim == case.head_dim else (None, 1, case.rot_dim)

    def rotate(xs):
        # Liger takes HF's [b, h, s, d] views of bshd memory and rotates the bshd storage.
        q, k = (_bshd_view(case, x).transpose(1, 2) for x in xs)
        q_out, k_out = fn(q, k, cos, sin, *extra)[:2]
        return tuple(_from_bshd(case, t.transpose(1, 2)) for t in (q_out, k_out))

    return _in_place_call(case, inputs, rotate)


# ---- flash-attn's Triton rotary --------------------------------------------------------------
def _flash_limits(case: RopeCase) -> str | None:
    if case.head_dim > 256:
        return f"head_dim {case.head_dim} > 256 (flash-attn asserts headdim <= 256)"
    return None


def _prepare_flash_attn(inplace: bool):
    def prepare(case: RopeCase, inputs: RopeInputs):
        apply_rotary = flash_attn_rotary().apply_rotary
        cos, sin = half_width_tables(case, inputs)  # [L, R/2]
        kw = dict(interleaved=case.style == "interleaved", inplace=inplace)
        if case.layout == "thd":
            kw.update(cu_seqlens=inputs.cu_seqlens, max_seqlen=case.seqlen)
        elif case.positions == "offset":
            kw.update(seqlen_offsets=inputs.offsets)

        def one(x):
            if case.layout == "thd":
                return apply_rotary(x, cos, sin, **kw)
            return _from_bshd(case, apply_rotary(_bshd_view(case, x), cos, sin, **kw))

        if inplace:
            return _in_place_call(case, inputs, lambda xs: [one(x) for x in xs])
        return forward_or_backward(case, inputs, lambda xs: [one(x) for x in xs])
    return prepare


# ---- FlashInfer ------------------------------------------------------------------------------
def _flashinfer():
    return import_peer("flashinfer.rope", "flashinfer-python")


def _flashinfer_prepare(form: str, inplace: bool):
    """``form``: ``indptr`` (apply_rope: per-sequence offsets), ``pos_ids`` (apply_rope_pos_ids)
    or ``cache`` (apply_rope_with_cos_sin_cache); each with its ``_inplace`` variant."""
    def prepare(case: RopeCase, inputs: RopeInputs):
        mod = _flashinfer()
        interleave = case.style == "interleaved"
        computed = dict(rotary_dim=case.rot_dim, interleave=interleave, rope_scale=1.0,
                        rope_theta=float(case.base))
        if form == "indptr":
            indptr = (inputs.cu_seqlens if case.layout == "thd" else torch.arange(
                0, case.tokens + 1, case.seqlen, device=inputs.x.device)).to(torch.int32)
            offsets = inputs.offsets.to(torch.int32)
            fn = mod.apply_rope_inplace if inplace else mod.apply_rope
            call = lambda q, k: fn(q, k, indptr, offsets, **computed)  # noqa: E731
        elif form == "pos_ids":
            pos_ids = _token_positions(inputs).to(torch.int32)
            fn = mod.apply_rope_pos_ids_inplace if inplace else mod.apply_rope_pos_ids
            call = lambda q, k: fn(q, k, pos_ids, **computed)  # noqa: E731
        else:
            half = lambda t: first_members(t, case.style)  # noqa: E731
            cache = torch.cat([half(inputs.cos), half(inputs.sin)], dim=-1).contiguous()
            positions = _token_positions(inputs)
            fn = (mod.apply_rope_with_cos_sin_cache_inplace if inplace
                  else mod.apply_rope_with_cos_sin_cache)

            def call(q, k):
                return fn(positions, q.flatten(-2), k.flatten(-2), case.head_dim, cache,
                          is_neox=not interleave)

        def rotate(xs):
            q, k = (_token_view(case, x) for x in xs)
            outs = call(q, k)
            outs = (q, k) if inplace else outs
            return tuple(o.view(x.shape) for o, x in zip(outs, xs))

        if inplace:
            return _in_place_call(case, inputs, rotate)
        return lambda: rotate(inputs.xs)
    return prepare


# ---- TransformerEngine -----------------------------------------------------------------------
def _te():
    """TE's ``apply_rotary_pos_emb`` (moved from ``attention`` to ``attention.rope`` in TE 2)."""
    try:
        return import_peer("transformer_engine.pytorch.attention.rope", "transformer-engine[pytorch]")
    except NotInstalled:
        return import_peer("transformer_engine.pytorch.attention", "transformer-engine[pytorch]")


def _prepare_te(case: RopeCase, inputs: RopeInputs):
    apply = _te().apply_rotary_pos_emb
    rows = inputs.angles.shape[0]
    freqs = expand_half(inputs.angles.to(torch.float32), case.style)  # fp32 angles [L, R]
    freqs = freqs.contiguous().view(rows, 1, 1, case.rot_dim)
    kw = dict(tensor_format=case.layout, interleaved=case.style == "interleaved", fused=True)
    if case.layout == "thd":
        kw.update(cu_seqlens=inputs.cu_seqlens)
    elif case.positions == "offset":
        kw.update(start_positions=inputs.offsets.to(torch.int32))
    return forward_or_backward(case, inputs, lambda xs: [apply(x, freqs, **kw) for x in xs])


# ---- vLLM ------------------------------------------------------------------------------------
def _vllm():
    return import_peer("vllm._custom_ops", "vllm")


def _prepare_vllm(case: RopeCase, inputs: RopeInputs):
    op = _vllm().rotary_embedding
    half = lambda t: first_members(t, case.style)  # noqa: E731
    cache = torch.cat([half(inputs.cos), half(inputs.sin)], dim=-1).contiguous()  # [L, R]
    positions = _token_positions(inputs)

    def rotate(xs):
        q = _token_view(case, xs[0])
        k = _token_view(case, xs[1]) if len(xs) > 1 else None
        op(positions, q, k, case.head_dim, cache, case.style == "rotate_half")
        return xs

    return _in_place_call(case, inputs, rotate)


# ---- the specs -------------------------------------------------------------------------------
def _specs() -> list[PeerSpec]:
    both = frozenset({"rotate_half", "interleaved"})
    all_positions = frozenset({"arange", "offset", "ids"})
    token_layouts = frozenset({"bshd", "thd"})
    flashinfer_common = dict(
        family="flashinfer", backend="torch", styles=both, layouts=token_layouts,
        dtypes=HALF_DTYPES, partial=True, backward=False, tensors_per_launch=2,
        kind="peer",
        launch="one block per (token tile, head tile); q and k heads in one launch",
        per_thread="vectorized chunk of the rotary dims", access="vector loads (last dim "
        "contiguous, token and head strides free)")
    flashinfer = []
    for form, fn, short, positions, source, what in (
            ("indptr", "apply_rope", "apply_rope", frozenset({"arange", "offset"}), "computed",
             "indptr (segments) + per-segment offsets"),
            ("pos_ids", "apply_rope_pos_ids", "pos_ids", all_positions, "computed",
             "per-token pos_ids"),
            ("cache", "apply_rope_with_cos_sin_cache", "cos_sin_cache", all_positions, "tables",
             "per-token positions + fp32 cat(cos, sin) cache")):
        for inplace in (False, True):
            name = f"flashinfer.{short}{'_inplace' if inplace else ''}"
            computed = source == "computed"
            flashinfer.append(PeerSpec(
                name=name, upstream=f"flashinfer-ai/flashinfer: flashinfer/rope.py ({fn})",
                summary=f"FlashInfer {fn}{' (in place)' if inplace else ''}: {what}",
                prepare=_flashinfer_prepare(form, inplace), positions=positions,
                table_source=source,
                table_dtypes=None if computed else frozenset({"fp32"}),
                angle_rel_err=ANGLE_REL_ERR_FAST_MATH if computed else 0.0,
                **_guard(_flashinfer, _needs_k),
                math=("fp32; angles from rope_theta with __powf/__sincosf fast intrinsics"
                      if computed else "fp32; cat(cos, sin) cache (must be fp32)"),
                caller_work=("segment indptr and per-segment offsets (int32)" if form == "indptr"
                             else "per-token positions" + (" and an fp32 cat(cos, sin) cache [L, R]"
                                                           if form == "cache" else "")),
                **flashinfer_common))
    return [
        PeerSpec(
            name="liger.rope", family="liger", backend="triton", kind="peer",
            upstream="linkedin/Liger-Kernel: src/liger_kernel/ops/rope.py (LigerRopeFunction)",
            summary="Liger LigerRopeFunction: HF cos/sin rows per token; q and k in one launch",
            prepare=_prepare_liger, styles=frozenset({"rotate_half"}), layouts=DENSE,
            dtypes=KERNEL_DTYPES, partial=True, positions=all_positions, backward=True,
            tensors_per_launch=2, tolerance_steps=LOW_PRECISION_STEPS,
            **_guard(_liger, _needs_k),
            launch="one program per token (b*s), every q and k head", per_thread="a head x R/2 "
            "tile", access="Triton tiles of the first R/2 and second R/2 channels",
            math="in the cos/sin dtype (x upcast or downcast to it); reads the first half of "
                 "each table row",
            caller_work="cos/sin rows [s, R] or gathered per token [b, s, R]; in place on "
                        "bshd-contiguous q/k",
            given_less_work=GATHERED_ROWS),
        *(PeerSpec(
            name=f"flash_attn.apply_rotary{'_inplace' if inplace else ''}", family="flash_attn",
            backend="triton", kind="peer",
            upstream="Dao-AILab/flash-attention: flash_attn/ops/triton/rotary.py (apply_rotary)",
            summary=f"flash-attn Triton rotary{' in place' if inplace else ''}: half-width "
                    "tables, seqlen_offsets or cu_seqlens",
            prepare=_prepare_flash_attn(inplace), styles=both,
            layouts=DENSE | {"thd"}, dtypes=KERNEL_DTYPES, partial=True,
            positions=frozenset({"arange", "offset"}), backward=False, index_bits=32,
            **_guard(flash_attn_rotary, _flash_limits),
            launch="grid (s / BLOCK_M, b, h): BLOCK_M tokens of one head per program",
            per_thread="a BLOCK_M x R/2 tile", access="strided Triton loads (any strides)",
            math="fp32 (x, cos, sin upcast)",
            caller_work="half-width cos/sin [L, R/2] (upcast to fp32 in the kernel); one call "
                        "per tensor")
          for inplace in (False, True)),
        *flashinfer,
        PeerSpec(
            name="transformer_engine.apply_rotary_pos_emb", family="transformer_engine", backend="torch", kind="peer",
            upstream="NVIDIA/TransformerEngine: transformer_engine/pytorch/attention/rope.py "
                     "(apply_rotary_pos_emb, fused=True)",
            summary="TransformerEngine fused RoPE: fp32 freqs, one call per tensor",
            prepare=_prepare_te, styles=both,
            layouts=frozenset({"sbhd", "bshd", "thd"}), dtypes=KERNEL_DTYPES, partial=True,
            positions=frozenset({"arange", "offset"}), backward=True, index_bits=32,
            table_source="angles32", **_guard(_te, _no_v),
            launch="block per token, sincosf once per token into shared memory",
            per_thread="one element per (d, h) stride step", access="scalar loads",
            math="fp32; sincosf of fp32 freqs",
            caller_work="fp32 angles (freqs) [L, 1, 1, R]; start_positions int32 [b]; one call "
                        "per tensor"),
        PeerSpec(
            name="vllm.rotary_embedding", family="vllm", backend="torch", kind="peer",
            upstream="vllm-project/vllm: csrc/pos_encoding_kernels.cu (_custom_ops."
                     "rotary_embedding)",
            summary="vLLM rotary_embedding custom op: per-token positions, cat(cos, sin) cache, in "
                    "place",
            prepare=_prepare_vllm, styles=both, layouts=token_layouts, dtypes=KERNEL_DTYPES,
            partial=True, positions=all_positions, backward=False, tensors_per_launch=2,
            tolerance_steps=LOW_PRECISION_STEPS,
            **_guard(_vllm, _no_v, _table_is_x_dtype),
            launch="block per token, threads over (head, pair)", per_thread="one pair",
            access="scalar loads", math="fp32 math on a cat(cos, sin) cache stored in x's dtype",
            caller_work="per-token positions (int64) and a cat(cos, sin) cache [L, R] in x's dtype; "
                        "in place"),
    ]


SPECS = _specs()
