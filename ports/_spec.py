"""What one implementation is and what it supports: the frozen record the registry lists.

A spec answers :meth:`ImplSpec.unsupported_reason` for any canonical case, and its ``prepare``
turns a case and its inputs into a zero-argument callable that does the work (what the harness
validates and times). Preparation (table conversion, building an autograd graph) stays outside
the timed call.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from reference import vocabulary
from reference.case import RopeCase, RopeInputs
from reference.tolerances import DEFAULT_STEPS
from reference.vocabulary import INT32_MAX

Backend = Literal["torch", "cupy", "triton"]
Kind = Literal["baseline", "port", "extension", "peer", "ablation"]
Prepared = Callable[[], tuple[torch.Tensor, ...]]
PrepareFn = Callable[[RopeCase, RopeInputs], Prepared]

# The vocabulary as sets, for the ImplSpec fields that say what an implementation supports.
ALL_STYLES = frozenset(vocabulary.STYLES)
ALL_LAYOUTS = frozenset(vocabulary.LAYOUTS)
DENSE_LAYOUTS = frozenset(vocabulary.DENSE_LAYOUTS)
ALL_POSITIONS = frozenset(vocabulary.POSITION_KINDS)
FLOAT_DTYPES = frozenset(vocabulary.KERNEL_DTYPES)  # the dtypes the GPU kernels take


@dataclass(frozen=True)
class ImplSpec:
    """One registered implementation.

    ``devices`` says where it runs: ``cuda``; ``cpu`` (eager torch); ``interpret`` (Triton under
    ``TRITON_INTERPRET=1``, on CPU tensors). ``index_bits`` is the width of the original's
    offsets: 32-bit designs refuse cases whose largest offset does not fit. ``table_source`` names
    where the rotation comes from (:mod:`reference.expected`), ``tolerance_steps`` and
    ``angle_rel_err`` set its tolerance (:mod:`reference.tolerances`); ``angle_rel_err`` may map
    dtype names to values, for designs whose angle precision follows the storage dtype. ``check``
    adds design-specific limits as a reason string (or ``None``).
    """

    name: str
    family: str
    backend: Backend
    upstream: str
    summary: str
    prepare: PrepareFn
    styles: frozenset[str]
    layouts: frozenset[str]
    dtypes: frozenset[str]
    partial: bool
    positions: frozenset[str]
    backward: bool
    tensors_per_launch: int = 1
    kind: Kind = "port"
    devices: frozenset[str] = frozenset({"cuda"})
    table_source: str = "tables"
    table_dtypes: frozenset[str] | None = None  # accepted cos_sin_dtype values (None: any)
    asymmetric_tables: bool = False
    strided: bool = True
    index_bits: int = 64
    max_kv_heads_differ: bool = True  # may q and k have different head counts?
    tolerance_steps: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_STEPS))
    angle_rel_err: float | Mapping[str, float] = 0.0
    check: Callable[[RopeCase], str | None] | None = None
    baseline: bool = False  # the eager-torch baseline for its style (speed-up column)
    compile_reference: bool = False  # the torch.compile row that "÷ compile" ratios divide by
    # Design notes (compare.py --design): how the original is launched and computes.
    launch: str = ""        # grid x block, what one program/block covers
    per_thread: str = ""    # elements one thread handles per iteration
    access: str = ""        # load/store width
    math: str = ""          # arithmetic precision and where cos/sin come from

    def unsupported_reason(self, case: RopeCase, targets: str | Iterable[str] = "cuda"
                           ) -> str | None:
        """``None`` if this implementation can run ``case``; else why not.

        ``targets`` are what this machine offers: ``"cuda"``, or ``{"cpu", "interpret"}``.
        """
        targets = {targets} if isinstance(targets, str) else set(targets)
        if not self.devices & targets:
            where = {"cuda": "an NVIDIA GPU", "cpu": "the CPU",
                     "interpret": "the Triton interpreter"}
            needs = " or ".join(where[d] for d in sorted(self.devices))
            return f"needs {needs} ({self.backend})"
        if case.style not in self.styles:
            return f"{case.style} convention not implemented"
        if case.layout not in self.layouts:
            return f"layout {case.layout} not supported (has {', '.join(sorted(self.layouts))})"
        if case.dtype not in self.dtypes:
            return f"dtype {case.dtype} not supported (has {', '.join(sorted(self.dtypes))})"
        if case.rot_dim != case.head_dim and not self.partial:
            return "partial rotary (rotary_dim < head_dim) not supported"
        if case.positions not in self.positions:
            return f"positions '{case.positions}' not supported"
        if case.direction == "backward" and not self.backward:
            return "no backward"
        if self.table_dtypes is not None and case.cos_sin_dtype not in self.table_dtypes:
            return f"cos/sin dtype '{case.cos_sin_dtype}' not accepted"
        if case.asymmetric and not self.asymmetric_tables:
            return "takes one angle per pair (cannot use asymmetric cos/sin)"
        if not case.contiguous and not self.strided:
            return "needs contiguous input"
        if case.kv_heads is not None and case.kv_heads != case.heads and not self.max_kv_heads_differ:
            return "q and k must have the same head count"
        if self.index_bits == 32 and case.numel > INT32_MAX:
            return f"{case.numel} elements overflow the original's int32 offsets"
        if self.check is not None:
            return self.check(case)
        return None

    def steps(self, case: RopeCase) -> float:
        return self.tolerance_steps[case.dtype]

    def angle_err(self, case: RopeCase) -> float:
        """The relative angle error for ``case``: ``angle_rel_err``, or its entry for the dtype."""
        if isinstance(self.angle_rel_err, Mapping):
            return self.angle_rel_err[case.dtype]
        return self.angle_rel_err
