"""fastrope as the CUDA ``rotary_pos_emb`` kernel of Hugging Face's ``kernels`` package: no Hub
download, for training, inference and torch.compile.

transformers decorates a family's ``apply_rotary_pos_emb`` with
``@use_kernel_forward_from_hub("rotary_pos_emb")``, which turns it into an ``nn.Module`` instance
(one per family, shared by every model of it), and its attention class with
``@use_kernelized_func(apply_rotary_pos_emb)``, which lets ``kernels.kernelize`` find that
instance. ``kernelize`` looks ``"rotary_pos_emb"`` up in the active kernel mapping and replaces
the instance's ``forward`` with the mapped layer's. :func:`kernel_mapping` maps it, for CUDA
devices of compute capability 8.0 and up and all four modes, to a repository object whose
``load()`` returns :class:`FastropeRotary` (``kernels`` accepts any object with ``load()`` as a
repository; its local repositories need a built kernel folder, this needs none).

Usage (kernels 0.17)::

    from kernels import Mode, kernelize, use_kernel_mapping
    from ports.fastrope.hf_kernels import kernel_mapping

    with use_kernel_mapping(kernel_mapping()):
        model = kernelize(model, device="cuda", mode=Mode.TRAINING | Mode.TORCH_COMPILE)

The mapping's CUDA entry covers capabilities [80, max), narrower than the Hub default's
[0, max), so it wins when both are registered. ``device="cpu"`` finds no entry: kernels keeps
the original function (or, with ``use_fallback=False``, raises ``ValueError: No layer mapping
for `rotary_pos_emb` with device type `Device(type='cpu', ...)```). The replacement is per
family, not per model, as transformers' decorated function is; kernelize again under a mapping
without ``rotary_pos_emb`` to restore it. Families transformers does not decorate (Phi3,
StableLM, GPT-NeoX, Qwen3-Next, Cohere, GLM, GLM4 in 5.17) are never kernelized: use
:func:`hf.patch` for them. Nor is the fused QK-norm + RoPE: kernelize replaces one named
layer's ``forward`` at a time, and transformers exposes the q/k norm (``RMSNorm``, shared with
every other RMSNorm of the model) and the rotation (``rotary_pos_emb``) as two layers, the
attention class that holds the pair being none; ``hf.patch(model, fuse_qk_norm=True)`` fuses
them (:mod:`.hf_qknorm`).

Which family a call belongs to is learned in ``load()``, when kernelize first loads the layer:
every family of :data:`hf.FAMILIES` that transformers decorates is imported, checked with
:func:`hf.probe`, and given its :func:`hf.drop_in`. A decorated family outside the table (or one
whose probe fails, logged as a warning) keeps its own function, so nothing is served wrong;
calls fastrope does not serve (CPU tensors, other dtypes, ...) fall back to it as well.
"""
from __future__ import annotations

import functools
import importlib
import logging
import sys
from typing import Callable

import torch

from ports.fastrope import hf

LAYER_NAME = "rotary_pos_emb"  # transformers' name for apply_rotary_pos_emb in kernel mappings
MIN_CAPABILITY = 80  # bf16 needs sm_80; the kernel is tested on sm_90

logger = logging.getLogger(__name__)

# kernels' function module class of each served family -> that family's drop-in.
_DROP_INS: dict[type, Callable] = {}


class FastropeRotary(torch.nn.Module):
    """The layer ``kernelize`` puts in place of a family's ``apply_rotary_pos_emb``.

    kernels binds this ``forward`` to the family's function module, so ``type(self).forward``
    is still the family's own function. kernels requires a stateless layer with no members
    beyond these two flags and ``forward``, whose signature matches the function's.
    """

    can_torch_compile = True
    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        rotate = _DROP_INS.get(type(self))
        if rotate is None:  # a family the table does not serve: its own function
            return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)
        return rotate(q, k, cos, sin, unsqueeze_dim)


def learn_families() -> list[str]:
    """Give every decorated family of the table its drop-in (:data:`_DROP_INS`); returns the
    names served. Families transformers does not decorate are left to :func:`hf.patch`."""
    served = []
    for row in hf.FAMILIES.values():
        try:
            module = importlib.import_module(row.module)
        except ImportError:
            continue
        fn = hf.original_of(getattr(module, "apply_rotary_pos_emb", None))
        if not hasattr(fn, "kernel_layer_name"):
            continue  # not decorated: kernelize never sees it
        cls = type(fn)
        original = functools.partial(cls.forward, fn)  # the class's: never a replaced forward
        reason = hf.probe(row, original)
        if reason is not None:
            logger.warning("fastrope does not serve %s under kernelize: %s", row.module, reason)
            _DROP_INS.pop(cls, None)
            continue
        _DROP_INS[cls] = hf.drop_in(row, original)
        served.append(row.name)
    return served


class FastropeRepository:
    """A kernels repository (anything with ``load()``) holding :class:`FastropeRotary`."""

    def load(self) -> type[torch.nn.Module]:
        learn_families()
        return FastropeRotary

    def __str__(self) -> str:
        return "fastrope (ports.fastrope.hf_kernels, local)"


def kernel_mapping() -> dict:
    """The kernel mapping that makes ``kernelize`` rotate with fastrope on CUDA, for
    ``Mode.TRAINING`` and ``Mode.INFERENCE``, each with or without ``Mode.TORCH_COMPILE``.
    Pass it to ``kernels.use_kernel_mapping`` or ``register_kernel_mapping``."""
    try:
        from kernels import CUDAProperties, Device, Mode
    except ImportError as exc:
        raise ImportError("kernel_mapping needs Hugging Face's kernels package: pip install "
                          "'rope-ports[hf]' (or kernels)") from exc
    repo = FastropeRepository()
    modes = {Mode.TRAINING: repo, Mode.INFERENCE: repo,
             Mode.TRAINING | Mode.TORCH_COMPILE: repo, Mode.INFERENCE | Mode.TORCH_COMPILE: repo}
    cuda = Device(type="cuda", properties=CUDAProperties(min_capability=MIN_CAPABILITY,
                                                          max_capability=sys.maxsize))
    return {LAYER_NAME: {cuda: modes}}
