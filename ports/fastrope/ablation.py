"""Ablations: the package's kernel with one idea of its design switched off.

A :class:`Tuning` names what changes; :func:`apply_rope` and :func:`apply_rope_inplace` are the
public functions run with it (same arguments, plus ``tuning``). The registry's
``fastrope-ablation.*`` entries (canonical.py) and the tools under tools/ call these; the public
``ports.fastrope`` functions always run the design. DESIGN.md gives what each idea was worth.
"""
from __future__ import annotations

from dataclasses import dataclass

from ports.fastrope import run
from ports.fastrope.kernel import (ANGLE_FP32, BOTH_HALVES, DIVIDE, NO_CACHE_HINTS,
                                   RELOAD_TABLE)

FLAGS = RELOAD_TABLE | NO_CACHE_HINTS | ANGLE_FP32 | DIVIDE | BOTH_HALVES
SHAPE_RULES = ("auto", "fixed")


@dataclass(frozen=True)
class Tuning:
    """What changes from the design (the defaults are the design)."""

    flags: int = 0                  # kernel FLAGS: RELOAD_TABLE | NO_CACHE_HINTS | ... (kernel.py)
    shape_rule: str = "auto"        # "fixed": the prefill launch shape for every size
    vector_cap: int | None = None   # at most this many elements per access
    index_bits: int | None = None   # 64: 64-bit offsets even where 32-bit ones fit
    unroll: int | None = None       # heads per thread per step
    separate_launches: bool = False  # q and k in two launches
    memory_order: bool = True       # False: the sbhd grid walks each sequence in turn
    step_kernel: bool = True        # False: small and mid-sized problems take the main kernel
    step_heads: int | None = None   # heads per thread in the step kernel
    one_half_per_thread: bool = False  # out of place from tables: a thread per half + partner
    runtime_switches: bool = False  # the step kernel reads the problem's switches at run time
    hints_at_every_size: bool = False  # streaming hints even where the data fits in the L2

    def __post_init__(self):
        if not isinstance(self.flags, int) or self.flags & ~FLAGS or self.flags < 0:
            raise ValueError(f"flags must combine kernel.py's FLAGS bits ({FLAGS}), got "
                             f"{self.flags!r}")
        if self.shape_rule not in SHAPE_RULES:
            raise ValueError(f"shape_rule must be one of {SHAPE_RULES}, got {self.shape_rule!r}")
        for name, value in (("vector_cap", self.vector_cap), ("unroll", self.unroll),
                            ("step_heads", self.step_heads)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")
        if self.index_bits not in (None, 32, 64):
            raise ValueError(f"index_bits must be None, 32 or 64, got {self.index_bits!r}")

    def plan_options(self) -> dict:
        """The keyword arguments of ``plan.choose`` this tuning sets."""
        return dict(flags=self.flags, shape_rule=self.shape_rule, vector_cap=self.vector_cap,
                    index_bits=self.index_bits, unroll=self.unroll,
                    memory_order=self.memory_order, step_kernel=self.step_kernel,
                    step_heads=self.step_heads, one_half_per_thread=self.one_half_per_thread,
                    runtime_switches=self.runtime_switches,
                    hints_at_every_size=self.hints_at_every_size)


DESIGN = Tuning()


def apply_rope(q, k=None, *, tuning: Tuning, **kwargs):
    """``ports.fastrope.apply_rope(q, k, **kwargs)`` run with ``tuning``."""
    return run.rotate_autograd(q, k, in_place=False, tuning=_checked(tuning), **kwargs)


def apply_rope_inplace(q, k=None, *, tuning: Tuning, **kwargs):
    """``ports.fastrope.apply_rope_inplace(q, k, **kwargs)`` run with ``tuning``."""
    return run.rotate_autograd(q, k, in_place=True, tuning=_checked(tuning), **kwargs)


def _checked(tuning) -> Tuning:
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning must be an ablation.Tuning, got {type(tuning).__name__}")
    return tuning
