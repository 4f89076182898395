"""Paddle's V1 fused RoPE as registry entries: what it supports, and the call from a canonical case.

The convention mapping is the naming trap: canonical ``interleaved`` -> Paddle
``use_neox_rotary_style=True``; canonical ``rotate_half`` -> ``use_neox_rotary_style=False``
(``tests/test_paddle.py`` proves it on the CPU by intercepting the call, and
``tests/test_gpu_paddle.py`` with a hand-checked 4-element example).

* ``paddle.fused_rope``: given sin/cos, one call per tensor (q, then k): one launch each.
* ``paddle.fused_rope_qkv``: given sin/cos, q and k in one call: one launch when their head counts
  match, two (q; then k) for GQA/MQA, as upstream.
* ``paddle.fused_rope_computed``: sin/cos computed in the kernel from ``rotary_emb_base``
  (interleaved only, positions ``0..S-1`` only, as upstream's Python API allows), q and k in one
  call.

Given tables must be in q's dtype (the kernel reads them as q's element type), so the given-table
entries run only cases whose table dtype is x's dtype (``cos_sin_dtype="same"``, or fp32/fp64
tables for fp32/fp64 x) and are compared with the oracle of those very tables. Rows are indexed
by position: ``arange`` passes the first ``S`` rows without ``position_ids``; ``offset`` and
``ids`` pass the per-token positions as ``position_ids`` (already in range, so the host range
check, which syncs, is skipped in the timed call).
"""
from __future__ import annotations

from ports._adapters import forward_or_backward
from ports._spec import ALL_POSITIONS, ImplSpec
from reference.case import RopeCase, RopeInputs
from reference.vocabulary import DTYPES

UPSTREAM = ("PaddlePaddle/Paddle@09d06946:paddle/phi/kernels/fusion/gpu/fused_rope_utils.h "
            "(V1, launched by fused_rope_kernel.cu@e5b22f5e / fused_rope_grad_kernel.cu@5f908167)")

USE_NEOX_ROTARY_STYLE = {"interleaved": True, "rotate_half": False}  # the inverted flag name
TIME_MAJOR = {"sbhd": True, "bshd": False}

# Relative angle error of the computed path. The exponent is 2*floor(d/2) * (1.0f / D): both
# factors rounded to fp32 unless D is a power of two, so the exponent e (<= 1) carries up to
# 2 * 2^-24 relative error, which base^e turns into ln(base) * e * 2^-23 relative error of the
# frequency (1.1e-6 at base 10000; fp64 math still takes the fp32-rounded 1/D, half of it). powf,
# the reciprocal and s * inv add about four fp32 roundings (2.4e-7). 2e-6 covers bases up to ~1e6.
ANGLE_REL_ERR_PADDLE_V1 = 2e-6


def _given_tables_check(case: RopeCase) -> str | None:
    if case.table_dtype != case.torch_dtype:
        return "sin/cos must be in q's dtype (the kernel reads them as T)"
    return _common_check(case)


def _common_check(case: RopeCase) -> str | None:
    if case.style == "rotate_half" and case.head_dim % 4:
        return "rotate-half needs head_dim % 4 == 0 (partner chosen per 2-vector)"
    if case.style == "rotate_half" and case.direction == "backward" and case.asymmetric:
        return "rotate-half backward uses each element's own sine (exact for symmetric tables)"
    return None


def _qk_check(case: RopeCase) -> str | None:
    if case.kv_heads is None:
        return "takes q and k together (q alone: paddle.fused_rope)"
    return _given_tables_check(case)


def _computed_check(case: RopeCase) -> str | None:
    if case.kv_heads is not None and case.heads % case.kv_heads:
        return "q's head count must be a multiple of k's"
    return _common_check(case)


def _tables(case: RopeCase, inputs: RopeInputs):
    """sin, cos and position_ids as the original takes them (rows by position)."""
    if case.positions == "arange":
        return (inputs.sin[: case.seqlen].contiguous(), inputs.cos[: case.seqlen].contiguous(),
                None)
    return inputs.sin.contiguous(), inputs.cos.contiguous(), inputs.positions.contiguous()


def _call(case: RopeCase, xs, sin, cos, position_ids):
    from ports import paddle

    k = xs[1] if len(xs) > 1 else None
    v = xs[2] if len(xs) > 2 else None
    outs = paddle.fused_rotary_position_embedding(
        xs[0], k, v, sin=sin, cos=cos, position_ids=position_ids,
        use_neox_rotary_style=USE_NEOX_ROTARY_STYLE[case.style],
        time_major=TIME_MAJOR[case.layout], rotary_emb_base=case.base,
        check_position_ids=False)
    return tuple(o for o in outs if o is not None)


def _prepare_per_tensor(case: RopeCase, inputs: RopeInputs):
    sin, cos, ids = _tables(case, inputs)
    return forward_or_backward(
        case, inputs, lambda xs: tuple(_call(case, [x], sin, cos, ids)[0] for x in xs))


def _prepare_together(case: RopeCase, inputs: RopeInputs):
    sin, cos, ids = _tables(case, inputs)
    return forward_or_backward(case, inputs, lambda xs: _call(case, list(xs), sin, cos, ids))


def _prepare_computed(case: RopeCase, inputs: RopeInputs):
    return forward_or_backward(case, inputs, lambda xs: _call(case, list(xs), None, None, None))


_COMMON = dict(
    family="paddle", backend="cupy", upstream=UPSTREAM, layouts=frozenset({"bshd", "sbhd"}),
    dtypes=frozenset(DTYPES), partial=False, backward=True,
    strided=False, index_bits=64,
)
_BOTH = frozenset({"rotate_half", "interleaved"})

SPECS = [
    ImplSpec(name="paddle.fused_rope",
             launch='1-D grid-stride, block 64-512 from the SM count',
             per_thread='2 elements / iteration', access='2 x dtype (4 B fp16)',
             math='fp32 (fp64 for fp64), one rounding; int64 div/mod per element',
             summary="V1 1-D vectorized, given sin/cos, one tensor/call",
             prepare=_prepare_per_tensor, styles=_BOTH, positions=ALL_POSITIONS,
             tensors_per_launch=1, asymmetric_tables=True, check=_given_tables_check, **_COMMON),
    ImplSpec(name="paddle.fused_rope_qkv",
             launch='1-D grid-stride, q/k/v in one launch',
             per_thread='2 elements / iteration / tensor', access='2 x dtype (4 B fp16)',
             math='fp32 (fp64 for fp64), one rounding; int64 div/mod per element',
             summary="V1, q, k (and v) in one launch (two for GQA), given sin/cos",
             prepare=_prepare_together, styles=_BOTH, positions=ALL_POSITIONS,
             tensors_per_launch=3, asymmetric_tables=True, check=_qk_check, **_COMMON),
    ImplSpec(name="paddle.fused_rope_computed",
             launch='1-D grid-stride, q/k/v in one launch',
             per_thread='2 elements / iteration / tensor', access='2 x dtype (4 B fp16)',
             math='fp32 powf/sinf/cosf per element, one rounding',
             summary="V1, sin/cos computed from rotary_emb_base, q and k in one call",
             prepare=_prepare_computed, styles=frozenset({"interleaved"}),
             positions=frozenset({"arange"}), tensors_per_launch=3, table_source="computed",
             angle_rel_err=ANGLE_REL_ERR_PADDLE_V1, check=_computed_check, **_COMMON),
]
