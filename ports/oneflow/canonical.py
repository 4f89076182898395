"""OneFlow's ``fused_apply_rotary_emb`` as registry entries: what it supports, and the call from a
canonical case.

Mapping (``tests/test_oneflow.py`` proves it on the CPU by intercepting the call,
``tests/test_gpu_oneflow.py`` with hand-checked 4-element examples on the real kernels):

* convention: ``rotate_half`` -> ``mode="plane"``, ``interleaved`` -> ``mode="interval"``;
* layout: ``bshd`` -> ``x_layout="BMHK"``, ``sbhd`` -> ``"MBHK"``, ``bhsd`` -> ``"BHMK"`` (the
  output keeps x's layout);
* positions: ``arange`` passes no ``position_ids`` (row ``m``); ``offset`` and ``ids`` pass the
  per-token positions as int64 ``position_ids`` of shape ``[B, 1, M]`` (1-D rotary);
* partial rotary: ``rotary_size = rotary_dim``.

Entries:

* ``oneflow.plane`` / ``oneflow.interval``: given cos/sin (the case's full-width ``[L, R]``
  tables, per element, as OneFlow reads them). OneFlow takes them in x's dtype only, so these run
  only cases whose table dtype is x's dtype (``cos_sin_dtype="same"``, or fp32 tables for fp32 x)
  and are compared with the oracle of those very tables. Plane mode with partial rotary is
  refused: upstream reads the tables with row stride K, out of bounds.
* ``oneflow.plane_computed`` / ``oneflow.interval_computed``: angles computed in the kernel from
  ``base``, faithfully rounded to x's dtype; compared with the ideal angles under a per-dtype
  angle tolerance (:data:`ANGLE_REL_ERR_FAITHFUL`), which grows with the position.
* ``oneflow.plane_fp32_angle`` / ``oneflow.interval_fp32_angle`` (extension, not upstream): the
  same kernels with theta and the angle kept in fp32; held to the fp32 angle tolerance in every
  dtype.
"""
from __future__ import annotations

import math

from ports._spec import ALL_POSITIONS, ImplSpec
from reference.case import RopeCase, RopeInputs
from reference.vocabulary import KERNEL_DTYPES

UPSTREAM = ("Oneflow-Inc/oneflow@05ec5c10:oneflow/user/kernels/fused_attention_kernels.cu "
            "(IntervalKernel/PlaneKernel from 8c489e45; functor fused_attention_functor.cpp)")

X_LAYOUT = {"bshd": "BMHK", "sbhd": "MBHK", "bhsd": "BHMK"}
MODE = {"rotate_half": "plane", "interleaved": "interval"}

# Rounding steps of the output dtype (reference/tolerances.py). fp16/bf16 arithmetic is T: with
# given tables y = RN(RN(x0*c) - RN(x1*s)) loses <= 0.5 ulp per product and 0.5 at the sum, each
# product at most ~2 ulp(max|ref|) in size (max|ref| >= max|x|/sqrt(2) for a rotation): <= 2.5
# steps; computed tables add cos and sin rounded to T (two more half-ulp terms): <= 4.5. 6 steps
# leave margin. fp32 keeps the default (fma contraction, ~2 steps).
ONEFLOW_STEPS: dict[str, float] = {"fp32": 4.0, "fp16": 6.0, "bf16": 6.0}

# Relative angle error of the fp32 angle, pos * expf(2j * inv * logf(theta)) with
# theta = 1.0f / base: the exponent carries inv rounded (2^-24), logf (1 ulp, 2^-23) and two
# products (2 * 2^-24), i.e. 5 * 2^-24 of |ln theta| <= ln(base) absolute, which exp turns into
# relative error of the frequency; expf (2 ulp), theta's rounding and the product with pos add
# ~4 * 2^-24 more. For base <= 1e6: 13.8 * 3.0e-7 + 2.4e-7 = 4.4e-6.
MAX_BASE = 1e6
ANGLE_REL_ERR_FP32_DERIVED = math.log(MAX_BASE) * 5 * 2**-24 + 4 * 2**-24  # 4.35e-6
ANGLE_REL_ERR_FP32 = 5e-6  # the derivation, rounded up

# Faithful angles in fp16/bf16: theta = T(1/base) carries up to half an ulp of T (2^-11 fp16,
# 2^-8 bf16, relative, while theta is a normal number), which moves the frequency
# theta^(2j/(R/E)) by at most as much; the angle is then rounded to T (another 2^-11 / 2^-8).
# The angle error is this times the angle, so it grows with the position: at pos 2047 the bf16
# angle of pair 1 (R=128, ~1773 rad) may be off by up to ~14 rad (about 3.4 for typical
# roundings), i.e. the output is meaningless there; the tolerance says exactly that (it passes any
# rotation once the bound exceeds ~2 rad). tests/test_gpu_oneflow.py measures it by position.
ANGLE_REL_ERR_FAITHFUL: dict[str, float] = {
    "fp32": ANGLE_REL_ERR_FP32,
    "fp16": 2 * 2**-11 + ANGLE_REL_ERR_FP32,   # 9.8e-4
    "bf16": 2 * 2**-8 + ANGLE_REL_ERR_FP32,    # 7.8e-3
}
FP16_MIN_NORMAL = 2**-14  # theta = 1/base is subnormal in fp16 for base > 16384
FP16_MAX_POSITION = 65519  # pos * 1 rounds to inf in fp16 past this: cos/sin become NaN


def _common_check(case: RopeCase) -> str | None:
    if case.head_dim % 2:
        return "head_dim (K) must be even (port guard)"
    return None


def _tables_check(case: RopeCase) -> str | None:
    if case.table_dtype != case.torch_dtype:
        return "cos/sin must be in x's dtype (OneFlow's InferDataType)"
    if case.style == "rotate_half" and case.rot_dim != case.head_dim:
        return ("plane mode with given cos/sin and rotary_size < K reads the tables with row "
                "stride K, out of bounds: refused")
    return _common_check(case)


def _computed_check(case: RopeCase) -> str | None:
    if case.base > MAX_BASE:
        return f"angle tolerance derived for base <= {MAX_BASE:g}"
    return _common_check(case)


def _faithful_check(case: RopeCase) -> str | None:
    if case.dtype == "fp16":
        if 1.0 / case.base < FP16_MIN_NORMAL:
            return ("theta = 1/base is subnormal in fp16 (base > 16384): its rounding exceeds "
                    "the documented angle model (the port runs it, faithfully)")
        if case.table_rows - 1 > FP16_MAX_POSITION:
            return "fp16 angles overflow to inf past position 65519 (NaN output upstream too)"
    return _computed_check(case)


def _position_ids(case: RopeCase, inputs: RopeInputs):
    if case.positions == "arange":
        return None
    return inputs.positions[:, None, :].contiguous()  # [B, 1, M] int64


def _call(case: RopeCase, x, *, cos=None, sin=None, position_ids=None, fp32_angle=False):
    from ports import oneflow

    return oneflow.fused_apply_rotary_emb(
        x, cos=cos, sin=sin, position_ids=position_ids, x_layout=X_LAYOUT[case.layout],
        mode=MODE[case.style], base=case.base,
        rotary_size=case.rot_dim if case.rot_dim != case.head_dim else None,
        fp32_angle=fp32_angle, check_position_ids=False)


def _forward_only(case: RopeCase) -> None:
    if case.direction != "forward":
        raise NotImplementedError("OneFlow's fused_apply_rotary_emb has no backward")


def _prepare_tables(case: RopeCase, inputs: RopeInputs):
    _forward_only(case)
    ids = _position_ids(case, inputs)
    cos, sin = inputs.cos.contiguous(), inputs.sin.contiguous()
    return lambda: tuple(_call(case, x, cos=cos, sin=sin, position_ids=ids) for x in inputs.xs)


def _prepare_computed(fp32_angle: bool):
    def prepare(case: RopeCase, inputs: RopeInputs):
        _forward_only(case)
        ids = _position_ids(case, inputs)
        return lambda: tuple(_call(case, x, position_ids=ids, fp32_angle=fp32_angle)
                             for x in inputs.xs)

    return prepare


_COMMON = dict(
    family="oneflow", backend="cupy", upstream=UPSTREAM, layouts=frozenset(X_LAYOUT),
    dtypes=frozenset(KERNEL_DTYPES), partial=True, positions=ALL_POSITIONS,
    backward=False, tensors_per_launch=1, strided=False, index_bits=64,
    tolerance_steps=ONEFLOW_STEPS, launch="1-D grid-stride, 128 threads/block",
)
# Design notes (compare.py --design).
_PLANE_DESIGN = dict(per_thread="1 element (+ its partner)", access="scalar dtype loads")
_INTERVAL_DESIGN = dict(per_thread="pack of 8 (16-bit) / 4 (fp32) elements",
                        access="16 B packs")
_DIV = "; int div/mod per element (int32 < 2^30 elements, else int64)"
_PLANE, _INTERVAL = frozenset({"rotate_half"}), frozenset({"interleaved"})
_FP32_ANGLE = {d: ANGLE_REL_ERR_FP32 for d in KERNEL_DTYPES}

SPECS = [
    ImplSpec(name="oneflow.plane", summary="PlaneKernel: 1 elem/thread, given cos/sin in x's dtype",
             prepare=_prepare_tables, styles=_PLANE, asymmetric_tables=True,
             check=_tables_check, math="x's dtype, given table" + _DIV, **_PLANE_DESIGN,
             **_COMMON),
    ImplSpec(name="oneflow.interval",
             summary="IntervalKernel: pack of 2-8 elems/thread, given cos/sin in x's dtype",
             prepare=_prepare_tables, styles=_INTERVAL, asymmetric_tables=True,
             check=_tables_check, math="x's dtype, given table" + _DIV, **_INTERVAL_DESIGN,
             **_COMMON),
    ImplSpec(name="oneflow.plane_computed",
             summary="PlaneKernel, angles from base rounded to x's dtype (faithful)",
             prepare=_prepare_computed(False), styles=_PLANE, table_source="computed",
             angle_rel_err=ANGLE_REL_ERR_FAITHFUL, check=_faithful_check,
             math="angle and math in x's dtype" + _DIV, **_PLANE_DESIGN, **_COMMON),
    ImplSpec(name="oneflow.interval_computed",
             summary="IntervalKernel, angles from base rounded to x's dtype (faithful)",
             prepare=_prepare_computed(False), styles=_INTERVAL, table_source="computed",
             angle_rel_err=ANGLE_REL_ERR_FAITHFUL, check=_faithful_check,
             math="angle and math in x's dtype" + _DIV, **_INTERVAL_DESIGN, **_COMMON),
    ImplSpec(name="oneflow.plane_fp32_angle", kind="extension",
             summary="PlaneKernel, angles from base kept in fp32 (not upstream)",
             prepare=_prepare_computed(True), styles=_PLANE, table_source="computed",
             angle_rel_err=_FP32_ANGLE, check=_computed_check,
             math="fp32 angle, math in x's dtype" + _DIV, **_PLANE_DESIGN, **_COMMON),
    ImplSpec(name="oneflow.interval_fp32_angle", kind="extension",
             summary="IntervalKernel, angles from base kept in fp32 (not upstream)",
             prepare=_prepare_computed(True), styles=_INTERVAL, table_source="computed",
             angle_rel_err=_FP32_ANGLE, check=_computed_check,
             math="fp32 angle, math in x's dtype" + _DIV, **_INTERVAL_DESIGN, **_COMMON),
]
