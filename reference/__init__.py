"""Ground truth for the study: the float64 oracle, the cos/sin builders, the canonical case, the
tolerances, the eager baselines, and the shared vocabulary (:mod:`reference.vocabulary`: styles,
layouts, dtypes and the host checks every port uses).

Nothing here imports from ``ports``: the references sit at the bottom of the package.
"""
from reference.case import RopeCase, RopeInputs, make_inputs
from reference.oracle import apply_rope, rope_oracle, rope_oracle_backward, rotate
from reference.tables import angles, cos_sin, inv_freq, llama31_inv_freq, rope_tables

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
    "llama31_inv_freq",
    "rope_tables",
]
