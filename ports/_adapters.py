"""Helpers the canonical adapters share to turn a forward function into a prepared call."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from reference.case import RopeCase, RopeInputs
from reference.tables import first_members

Forward = Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]]


def forward_or_backward(case: RopeCase, inputs: RopeInputs, forward: Forward):
    """A zero-argument call: ``forward(xs)`` for forward cases; for backward cases the gradient
    through ``forward`` by autograd, with the graph built once here (outside the timed call)."""
    if case.direction == "forward":
        return lambda: tuple(forward(inputs.xs))
    leaves = [x.detach().requires_grad_(True) for x in inputs.xs]
    outs = forward(leaves)
    grads = inputs.grads

    def backward():
        return torch.autograd.grad(outs, leaves, grads, retain_graph=True)

    return backward


def half_width_tables(case: RopeCase, inputs: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's symmetric cos/sin tables with one value per pair, ``[L, R/2]``, contiguous: the
    form flash-attn takes (and fastrope's rows get), built once in ``prepare``."""
    return (first_members(inputs.cos, case.style).contiguous(),
            first_members(inputs.sin, case.style).contiguous())


def per_tensor(fn: Callable[[torch.Tensor], torch.Tensor]) -> Forward:
    """Apply a one-tensor function to each tensor of the case, one call each."""
    return lambda xs: tuple(fn(x) for x in xs)


def in_place_call(case: RopeCase, inputs: RopeInputs, rotate: Forward):
    """A zero-argument call of an in-place ``rotate(buffers)`` on copies of the case's tensors
    made here, forward only: the first call is the one validated; later (timed) calls rotate the
    same buffers again."""
    buffers = [x.clone() for x in inputs.xs]
    return lambda: tuple(rotate(buffers))
