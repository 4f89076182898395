"""Helpers the canonical adapters share to turn a forward function into a prepared call."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from reference.case import RopeCase, RopeInputs
from reference.tables import first_members

Forward = Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]]


def backward_alone(forward: Callable[[], Sequence[torch.Tensor]], leaves: Sequence[torch.Tensor],
                   grads: Sequence[torch.Tensor]) -> Callable[[], tuple[torch.Tensor, ...]]:
    """A call of the backward alone: the gradients of ``forward()``'s outputs for ``grads``
    with respect to ``leaves``, by autograd, its graph kept between calls. ``forward`` runs here,
    once, on a stream of its own on CUDA, and the call carries that stream as
    ``capture_stream``: autograd runs a backward on its forward's stream, so a CUDA graph holds
    the backward's kernels only when captured there (``ports.harness.timing.graph_median_us``).
    The leaves' gradient accumulators are made on that stream too, so give leaves that no other
    kept graph uses."""
    stream = None
    if leaves[0].is_cuda:
        stream = torch.cuda.Stream(leaves[0].device)
        stream.wait_stream(torch.cuda.current_stream(leaves[0].device))
    with torch.cuda.stream(stream):
        outs = forward()

    def backward():
        return torch.autograd.grad(outs, leaves, grads, retain_graph=True)

    backward.capture_stream = stream
    return backward


class AutogradCall:
    """A backward case's prepared call: the gradients of ``forward(leaves)`` for ``grads`` by
    autograd, its graph built once here (outside the timed call)."""

    def __init__(self, forward: Forward, leaves: Sequence[torch.Tensor],
                 grads: Sequence[torch.Tensor]):
        self._forward, self.leaves, self.grads = forward, list(leaves), grads
        self._outs = forward(self.leaves)

    def __call__(self):
        return torch.autograd.grad(self._outs, self.leaves, self.grads, retain_graph=True)

    def backward_alone(self):
        """This call for a CUDA-graph timing of the backward's kernels (:func:`backward_alone`),
        on leaves of its own (views of the same tensors): this call's kept graph holds its
        leaves' gradient accumulators, made on the stream it ran on."""
        leaves = [x.detach().requires_grad_(True) for x in self.leaves]
        return backward_alone(lambda: self._forward(leaves), leaves, self.grads)


def forward_or_backward(case: RopeCase, inputs: RopeInputs, forward: Forward):
    """A zero-argument call: ``forward(xs)`` for forward cases; for backward cases the gradient
    through ``forward`` by autograd (:class:`AutogradCall`)."""
    if case.direction == "forward":
        return lambda: tuple(forward(inputs.xs))
    return AutogradCall(forward, [x.detach().requires_grad_(True) for x in inputs.xs],
                        inputs.grads)


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
