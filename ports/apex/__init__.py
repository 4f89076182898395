"""NVIDIA apex's fused RoPE (``apex.transformer.functional.fused_rope``) as CuPy RawKernels.

Provenance (Apache-2.0; re-implemented from the design, no code copied):

* kernels and host code: ``NVIDIA/apex@6424da3b:csrc/megatron/_launch.h``,
  ``.cpp`` and ``_cuda.cu`` (kernel semantics unchanged since ``23c1f865``), ported in ``rope.cu``
  and :mod:`ports.apex._launch` (the extension layer, exported here under apex's name
  ``fused_rotary_positional_embedding``);
* Python wrappers and test: ``NVIDIA/apex@3c98f93d:apex/transformer/functional/fused_rope.py`` and
  ``tests/L0/run_transformer/test_fused_rope.py`` (the wrappers were later deleted from apex main
  in ``4fcca776``; the extension is still built), ported here.

Four public functions, each a :class:`torch.autograd.Function` with the original's signature,
defaults, shapes, output allocation and saved tensors, whose backward is the original's backward
kernel (rotate-half only: element ``j`` pairs with ``j + d2/2``):

=============================================  ============================  ==================
function                                       x (any strides)               saved for backward
=============================================  ============================  ==================
``fused_apply_rotary_pos_emb(t, freqs,         ``[s, b, h, d]``; freqs fp32  ``freqs``, flag
transpose_output_memory=False)``               angles ``[s, 1, 1, d2]``
``fused_apply_rotary_pos_emb_cached(t, cos_,   ``[s, b, h, d]``; cos/sin     ``cos_``, ``sin_``,
sin_, transpose_output_memory=False)``         ``[s, 1, 1, d2]`` fp32 or     flag
                                               t's dtype
``fused_apply_rotary_pos_emb_thd(t,            packed ``[t, h, d]``;         ``cu_seqlens``,
cu_seqlens, freqs)``                           ``cu_seqlens [b+1]`` int32;   ``freqs``
                                               freqs ``[max_s, 1, 1, d2]``
``fused_apply_rotary_pos_emb_2d(t, img_h,      ``[b, img_h*img_w, h, d]``;   the four tables,
img_w, cos_h, sin_h, cos_w, sin_w)``           tables ``[1, H|W, 1, d/2]``   ``img_h``, ``img_w``
=============================================  ============================  ==================

Outputs are new tensors: sbhd ``[s, b, h, d]`` contiguous, or with ``transpose_output_memory``
logical ``[s, b, h, d]`` over ``[b, s, h, d]`` memory (``out.transpose(0, 1)`` is contiguous; the
backward allocates the input gradient the same way); thd contiguous ``[t, h, d]``; 2-D contiguous
``[b, img_h*img_w, h, d]``. Positions are implicit: the angle row is the token's ``s`` index
(thd: its index inside its own sequence; 2-D: row ``ih`` for channels ``[0, d/2)``, column ``iw``
for ``[d/2, d)``). Channels ``d2 <= j < d`` are copied (partial rotary).

DESIGN (kept from ``rope.cu``): one block per token, grid ``(s, b)`` / ``(max_s, b)`` for thd /
``(ih, iw, b)`` for 2-D; block ``(32, 4 if h < 16 else 8)``; threads stride over rotated dims
(x) and heads (y), then a tail-copy loop; scalar loads with every stride a kernel argument; int32
offsets; ``sincosf`` of the fp32 angle in the forward, ``cosf``/``sinf`` of the element's and its
partner's angle in the backward (the exact transpose, correct for any per-element angles); no
shared memory; torch's current stream; no ``--use_fast_math`` (apex's ``setup.py`` has none).

Precision. Arithmetic happens in the storage type, as in the original: for fp16 / bf16 that is
c10's ``Half`` / ``BFloat16``, where cos/sin are first rounded to the dtype, and each ``*`` and
``+`` computes in fp32 and rounds back (RNE): ``y = T(T(x*T(c)) + T(rot*T(s)))``. The kernel
emulates those types exactly (no float expression spans two operators, so no compiler can fuse
them), so fp16 / bf16 results are bit-identical to apex's compiled kernel given the same cos/sin;
tests/test_gpu_apex.py checks them bitwise against a torch emulation of that rounding, and that
the check can tell it from fp32 math with one rounding. The freqs paths' ``sincosf`` / ``cosf`` /
``sinf`` are libdevice's accurate routines in both builds. For fp32, ``x*c + rot*s`` is one float
expression that NVRTC, like nvcc (``--fmad=true``), contracts to an FMA; which product is fused is
the compiler's choice, so other compiler versions may round fp32 results differently.

Departures from the original, each a host-side addition (the kernels' math and launch are
apex's):

* Every ``TORCH_CHECK`` of the ``.cpp`` (and the dtype dispatch's refusals) raised before any
  launch as a Python exception: ``ValueError`` for ranks / sizes, ``TypeError`` for dtypes.
  The 2-D wrapper's ``assert``s are ``ValueError``s too (``assert`` vanishes under ``-O``).
* Added checks, also before any launch: CUDA tensors on one device (checked last); cos/sin/freqs
  dense (the kernel indexes them as ``[rows, d2]``; the original silently misreads views); even
  ``d2`` (2-D: ``d % 4 == 0``); ``b`` (2-D: ``iw``, ``b``) within the grid's 65535 y/z limit;
  thd ``cu_seqlens`` int32 with at least one entry; 2-D ``sin_*`` shapes and all four dtypes
  checked against ``cos_h`` in the extension layer too.
* Inputs whose largest element offset (of the input, the output or a table) does not fit int32
  are refused with ``NotImplementedError`` (the original's host code narrows sizes and strides to
  ``int`` and wraps). A size-1 axis gets stride 0 (it is only indexed at 0).
* thd: ``cu_seqlens`` values are validated on the host: ``0 <= cu[0]``, non-decreasing,
  ``cu[-1] <= t``, every length ``<= max_s = freqs.size(0)``. This is a **device-to-host copy,
  i.e. a stream synchronisation** per forward call (the original reads the values only in the
  kernel). The autograd backward reuses the forward's validation (saved tensors cannot change
  in place without autograd noticing); ``backward_thd`` called directly validates again.
* thd: output rows outside ``[cu[0], cu[-1])`` are zero-filled (the original returns them
  uninitialised from ``torch::empty``); with the lengths validated nothing else is unwritten.
* Empty tensors return an empty output without a launch (the original launches a zero-sized grid
  and raises).
* bf16 / fp16 tensors are handed to the kernel as raw 2-byte storage and reinterpreted as the
  c10-style types (no torch extension, no ATen headers).
* The port's host code (Python checks, CuPy launch) costs more time per call than apex's C++
  layer; only calls whose kernel is a few microseconds long can show it.
"""
from __future__ import annotations

import torch

from ports.apex import _launch
from ports.apex._launch import MODULE

fused_rotary_positional_embedding = _launch  # the extension layer under apex's name for it


class FusedRoPEFunc(torch.autograd.Function):
    """RoPE with fp32 angles ``freqs`` (sbhd, any input strides)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor,
                transpose_output_memory: bool = False) -> torch.Tensor:
        output = _launch.forward(t, freqs, transpose_output_memory)
        ctx.save_for_backward(freqs)
        ctx.transpose_output_memory = transpose_output_memory
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (freqs,) = ctx.saved_tensors
        grad_input = _launch.backward(grad_output, freqs, ctx.transpose_output_memory)
        return grad_input, None, None


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor,
                               transpose_output_memory: bool = False) -> torch.Tensor:
    """Apply RoPE to ``t`` in ``sbhd`` format with angles ``freqs``.

    Parameters
    ----------
    t
        ``[s, b, h, d]``, float32 / float16 / bfloat16, CUDA, any strides.
    freqs
        ``[s, 1, 1, d2]`` float32 angles, dense, ``d2 <= d`` even; row ``i`` holds token ``i``'s
        angles in the rotate-half layout (Megatron: ``cat(pos * inv_freq, pos * inv_freq)``).
    transpose_output_memory
        If true the output's memory is ``[b, s, h, d]`` (``out.transpose(0, 1)`` is contiguous).

    Returns
    -------
    torch.Tensor
        A new ``[s, b, h, d]`` tensor of ``t``'s dtype: ``t[..., :d2] * cos + rotate_half(t[...,
        :d2]) * sin`` (cos/sin of ``freqs`` computed in the kernel), ``t[..., d2:]`` copied.

    Examples
    --------
    >>> s, b, h, d = 4, 2, 8, 64                                        # doctest: +SKIP
    >>> inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda") / d)  # doctest: +SKIP
    >>> ang = torch.outer(torch.arange(s, device="cuda"), inv)           # doctest: +SKIP
    >>> freqs = torch.cat([ang, ang], -1).float().view(s, 1, 1, d)      # doctest: +SKIP
    >>> x = torch.randn(s, b, h, d, device="cuda")                     # doctest: +SKIP
    >>> y = fused_apply_rotary_pos_emb(x, freqs)                         # doctest: +SKIP
    """
    return FusedRoPEFunc.apply(t, freqs, transpose_output_memory)


class FusedRoPECachedFunc(torch.autograd.Function):
    """RoPE with given cos/sin tables (sbhd, any input strides)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor,
                transpose_output_memory: bool = False) -> torch.Tensor:
        output = _launch.forward_cached(t, cos_, sin_, transpose_output_memory)
        ctx.save_for_backward(cos_, sin_)
        ctx.transpose_output_memory = transpose_output_memory
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        cos_, sin_ = ctx.saved_tensors
        grad_input = _launch.backward_cached(grad_output, cos_, sin_, ctx.transpose_output_memory)
        return grad_input, None, None, None


def fused_apply_rotary_pos_emb_cached(t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor,
                                      transpose_output_memory: bool = False) -> torch.Tensor:
    """Apply RoPE to ``t`` in ``sbhd`` format with cached cos/sin.

    Parameters
    ----------
    t
        ``[s, b, h, d]``, float32 / float16 / bfloat16, CUDA, any strides.
    cos_, sin_
        ``[s, 1, 1, d2]``, dense, ``d2 <= d`` even; float32 or ``t``'s dtype (both the same).
        Rounded to ``t``'s dtype in the kernel. The two halves may differ: the backward uses each
        partner's sine, so it is the exact transpose for any tables.
    transpose_output_memory
        If true the output's memory is ``[b, s, h, d]``.

    Returns
    -------
    torch.Tensor
        A new ``[s, b, h, d]`` tensor: ``t[..., :d2] * cos_ + rotate_half(t[..., :d2]) * sin_``,
        ``t[..., d2:]`` copied.
    """
    return FusedRoPECachedFunc.apply(t, cos_, sin_, transpose_output_memory)


class FusedRoPETHDFunc(torch.autograd.Function):
    """RoPE of packed variable-length sequences (thd)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cu_seqlens: torch.Tensor,
                freqs: torch.Tensor) -> torch.Tensor:
        output, ctx.covered = _launch.rope_thd("forward", t, cu_seqlens, freqs, "input")
        ctx.save_for_backward(cu_seqlens, freqs)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        cu_seqlens, freqs = ctx.saved_tensors
        grad_input, _ = _launch.rope_thd("backward", grad_output, cu_seqlens, freqs,
                                         "output_grads", covered=ctx.covered)
        return grad_input, None, None


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor,
                                   freqs: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to packed sequences ``t`` in ``thd`` format.

    Parameters
    ----------
    t
        ``[t, h, d]`` (sequences packed along t), float32 / float16 / bfloat16, CUDA, any strides.
    cu_seqlens
        ``[b + 1]`` int32 on t's device: sequence ``i`` is tokens ``cu_seqlens[i] ..
        cu_seqlens[i+1] - 1``. Validated on the host (a device-to-host copy: stream sync).
    freqs
        ``[max_s, 1, 1, d2]`` float32 angles; token ``k`` of every sequence uses row ``k``.

    Returns
    -------
    torch.Tensor
        A new contiguous ``[t, h, d]`` tensor; rows outside ``[cu_seqlens[0], cu_seqlens[-1])``
        are zeros.
    """
    return FusedRoPETHDFunc.apply(t, cu_seqlens, freqs)


class FusedRoPE2DFunc(torch.autograd.Function):
    """2-D (image) RoPE: height half and width half rotated separately."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, img_h: int, img_w: int, cos_h: torch.Tensor,
                sin_h: torch.Tensor, cos_w: torch.Tensor, sin_w: torch.Tensor) -> torch.Tensor:
        t = t.view(t.shape[0], img_h, img_w, t.shape[2], t.shape[3])
        output = _launch.forward_2d(t, cos_h, sin_h, cos_w, sin_w)
        ctx.save_for_backward(cos_h, sin_h, cos_w, sin_w)
        ctx.img_h = img_h
        ctx.img_w = img_w
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_output = grad_output.view(grad_output.shape[0], ctx.img_h, ctx.img_w,
                                       grad_output.shape[2], grad_output.shape[3])
        cos_h, sin_h, cos_w, sin_w = ctx.saved_tensors
        grad_input = _launch.backward_2d(grad_output, cos_h, sin_h, cos_w, sin_w)
        return grad_input, None, None, None, None, None, None


def fused_apply_rotary_pos_emb_2d(t: torch.Tensor, img_h: int, img_w: int, cos_h: torch.Tensor,
                                  sin_h: torch.Tensor, cos_w: torch.Tensor,
                                  sin_w: torch.Tensor) -> torch.Tensor:
    """Apply 2-D RoPE to image tokens ``t`` in ``bshd`` format (``s = img_h * img_w``, row-major).

    Channels ``[0, d/2)`` get a rotate-half of width ``d/2`` (pairs ``(k, k + d/4)``) with
    ``cos_h``/``sin_h`` row ``ih`` (the token's image row); channels ``[d/2, d)`` get one with
    ``cos_w``/``sin_w`` row ``iw`` (its column).

    Parameters
    ----------
    t
        ``[b, img_h * img_w, h, d]``, float32 / float16 / bfloat16, CUDA, strides that allow
        ``t.view(b, img_h, img_w, h, d)``; ``d % 4 == 0``.
    img_h, img_w
        Image height and width in tokens.
    cos_h, sin_h
        ``[1, H, 1, d/2]`` with ``H >= img_h``, dense, float32 or ``t``'s dtype.
    cos_w, sin_w
        ``[1, W, 1, d/2]`` with ``W >= img_w``, dense, the same dtype as ``cos_h``.

    Returns
    -------
    torch.Tensor
        A new contiguous ``[b, img_h * img_w, h, d]`` tensor.
    """
    _launch.check_2d_view(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w)
    return FusedRoPE2DFunc.apply(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w)


__all__ = [
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
    "fused_apply_rotary_pos_emb_2d",
    "FusedRoPEFunc",
    "FusedRoPECachedFunc",
    "FusedRoPETHDFunc",
    "FusedRoPE2DFunc",
    "MODULE",
    "fused_rotary_positional_embedding",
]
