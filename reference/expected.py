"""What each implementation should produce: the float64 oracle on the inputs it consumed.

Designs take the rotation from different sources; comparing each against the oracle of its own
source measures the kernel's arithmetic rather than the rounding of tables it was handed.

* ``tables``: the given cos/sin tables (``inputs.cos``/``inputs.sin``, any dtype), upcast.
* ``angles32``: the ideal angles rounded to fp32 (apex's ``freqs``, seed 000's Triton), then exact
  cos/sin.
* ``computed``: the ideal float64 angles; the kernel computes its own and the tolerance gets an
  angle term (:mod:`reference.tolerances`).
"""
from __future__ import annotations

import torch

from reference.case import RopeCase, RopeInputs
from reference.layouts import positions_for_layout
from reference.oracle import rope_oracle, rope_oracle_backward, rotate
from reference.tables import expand_half
from reference.tolerances import tolerance

TABLE_SOURCES: tuple[str, ...] = ("tables", "angles32", "computed")


def oracle_tables(case: RopeCase, inputs: RopeInputs, source: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width float64 cos/sin tables ``[L, R]`` for the given source."""
    if source == "tables":
        return inputs.cos.to(torch.float64), inputs.sin.to(torch.float64)
    if source not in TABLE_SOURCES:
        raise ValueError(f"unknown table source {source!r}; expected one of {TABLE_SOURCES}")
    if case.asymmetric:
        raise ValueError(f"asymmetric tables cannot come from source {source!r}")
    ang = inputs.angles
    if source == "angles32":
        ang = ang.to(torch.float32).to(torch.float64)
    full = expand_half(ang, case.style)
    return torch.cos(full), torch.sin(full)


def expected(case: RopeCase, inputs: RopeInputs, source: str = "tables") -> tuple[torch.Tensor, ...]:
    """float64 outputs (forward) or input gradients (backward), one per tensor of ``inputs.xs``."""
    cos, sin = oracle_tables(case, inputs, source)
    kw = dict(layout=case.layout, style=case.style)
    if case.direction == "forward":
        return tuple(rope_oracle(x, cos, sin, inputs.positions, **kw) for x in inputs.xs)
    return tuple(rope_oracle_backward(x, g, cos, sin, inputs.positions, **kw)
                 for x, g in zip(inputs.xs, inputs.grads))


def tolerances(case: RopeCase, inputs: RopeInputs, refs: tuple[torch.Tensor, ...], *,
               steps: float, angle_rel_err: float = 0.0) -> tuple[torch.Tensor, ...]:
    """Element-wise tolerances for ``refs`` (see :func:`reference.tolerances.tolerance`)."""
    out = []
    operands = inputs.xs if case.direction == "forward" else inputs.grads
    for ref, operand in zip(refs, operands):
        angle = pair = None
        if angle_rel_err:
            ang_table = expand_half(inputs.angles, case.style)
            angle = ang_table[positions_for_layout(inputs.positions, case.layout)]
            op = operand[..., : case.rot_dim].to(torch.float64).abs()
            pair = op + rotate(op, case.style).abs()
        out.append(tolerance(ref, case.torch_dtype, steps=steps, angle_rel_err=angle_rel_err,
                             angle=angle, pair_magnitude=pair))
    return tuple(out)


__all__ = ["TABLE_SOURCES", "oracle_tables", "expected", "tolerances"]
