"""Ground truth for the study: float64 oracle, cos/sin builders, the canonical case and eager baselines.

Nothing here imports from ``ports``: the references sit at the bottom of the package.
"""
from reference.case import RopeCase, RopeInputs, make_inputs
from reference.oracle import apply_rope, rope_oracle, rope_oracle_backward, rotate
from reference.tables import angles, cos_sin, inv_freq, rope_tables

__all__ = [
    "RopeCase",
    "RopeInputs",
    "make_inputs",
    "apply_rope",
    "rope_oracle",
    "rope_oracle_backward",
    "rotate",
    "angles",
    "cos_sin",
    "inv_freq",
    "rope_tables",
]
