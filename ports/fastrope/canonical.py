"""Registry entries for the package's own kernel, and its ablations (one idea switched off each).

* ``fastrope.rope``: given cos/sin tables (fp32/fp16/bf16), q and k in one call.
* ``fastrope.rope_computed``: angles computed in the kernel in fp64 from the case's ``inv_freq``.
* ``fastrope.rope_inplace``: ``apply_rope_inplace`` on copies made in ``prepare`` (the timed call
  rotates the same buffers again and again; the first call is the one validated).

Tables. Where the case's tables are symmetric (both members of a pair share cos/sin: every
standard RoPE table), fastrope gets them half width, ``[L, R/2]``, made once in ``prepare``: the
tensors flash-attn gets, and the half of each row that Liger reads. Asymmetric tables (cases
with ``asymmetric=True``) go in full width ``[L, R]``; the ``full_tables`` ablation gives full
width always.

Positions go in as the case has them: ``arange`` needs nothing, ``offset`` passes the
per-sequence offsets, ``ids`` the per-token ids; ``check_positions=False`` in the timed call
(the inputs are in range by construction; the API's default check costs one device sync).

The ablation entries (kind ``ablation``, family ``fastrope-ablation``) run only when named
(``compare.py --suite ablation --only fastrope fastrope-ablation``).
"""
from __future__ import annotations

import functools

from ports._adapters import forward_or_backward, half_width_tables
from ports._spec import ALL_LAYOUTS, ALL_POSITIONS, ImplSpec
from reference.case import RopeCase, RopeInputs

UPSTREAM = "this package (ports/fastrope): the package's own kernel, no upstream"
DTYPES = frozenset({"fp32", "fp16", "bf16"})
STYLES = frozenset({"rotate_half", "interleaved"})
# Computed angles: pos * inv_freq in fp64 (exact to ~1e-16), then fp64 sincos rounded to fp32:
# the only angle error left is far below the fp32 rounding of cos/sin that the steps cover.
ANGLE_REL_ERR_FP64 = 1e-12
# fp32_angles ablation (kernel.FP32_ANGLES): fp32 product and sincosf, ~2 fp32 roundings of the
# angle.
ANGLE_REL_ERR_FP32_ANGLE = 4e-7


def _table_check(case: RopeCase) -> str | None:
    if case.table_dtype.itemsize > 4:
        return "takes fp32/fp16/bf16 cos/sin (fp64 tables: pass .float())"
    return None


def _kwargs(case: RopeCase, inputs: RopeInputs, computed: bool, full_tables: bool) -> dict:
    kw = dict(style=case.style, layout=case.layout, rotary_dim=case.rot_dim,
              check_positions=False)
    if computed:
        kw.update(inv_freq=inputs.inv_freq)
    elif case.asymmetric or full_tables:
        kw.update(cos=inputs.cos, sin=inputs.sin)
    else:  # one value per pair, [L, R/2] (the module doc says why)
        cos, sin = half_width_tables(case, inputs)
        kw.update(cos=cos, sin=sin)
    if case.layout == "thd":
        kw.update(cu_seqlens=inputs.cu_seqlens, max_seqlen=max(case.seqlens))
    if case.positions == "offset":
        kw.update(offsets=inputs.offsets)
    elif case.positions == "ids":
        kw.update(positions=inputs.positions)
    return kw


def _rotate(case, kw, xs, fn):
    """q and k in one call; v (Paddle's q/k/v case) in a second."""
    outs = fn(xs[0], xs[1], **kw) if len(xs) > 1 else (fn(xs[0], **kw),)
    if len(xs) > 2:
        outs = (*outs, fn(xs[2], **kw))
    return tuple(outs)


def _preparer(computed: bool = False, in_place: bool = False, ablation: str | None = None,
              full_tables: bool = False):
    """The registry's ``prepare``: the public functions, or with an ``ablation`` (a name of
    ``ablation.ABLATIONS``) the ablation module's; ``full_tables``: the case's ``[L, R]`` tables
    even when they are symmetric."""
    def prepare(case: RopeCase, inputs: RopeInputs):
        if ablation is None:
            from ports.fastrope import apply_rope, apply_rope_inplace
        else:
            from ports.fastrope import ablation as module

            apply_rope = functools.partial(module.apply_rope, ablation=ablation)
            apply_rope_inplace = functools.partial(module.apply_rope_inplace, ablation=ablation)

        kw = _kwargs(case, inputs, computed, full_tables)
        if not in_place:
            return forward_or_backward(
                case, inputs, lambda xs: _rotate(case, kw, xs, apply_rope))
        if case.direction == "backward":  # in place on a copy (autograd refuses leaves)
            return forward_or_backward(case, inputs, lambda xs: _rotate(
                case, kw, [x.clone() for x in xs], apply_rope_inplace))
        buffers = [x.clone() for x in inputs.xs]
        return lambda: _rotate(case, kw, buffers, apply_rope_inplace)

    return prepare


_COMMON = dict(
    family="fastrope", backend="cupy", kind="extension", upstream=UPSTREAM, styles=STYLES,
    layouts=ALL_LAYOUTS, dtypes=DTYPES, partial=True, positions=ALL_POSITIONS, backward=True,
    tensors_per_launch=2, strided=True, index_bits=64, asymmetric_tables=True,
    launch="grid (s/tokens, b, head splits) x block (chunks, head lanes, tokens), from the size;"
           " sbhd: tokens in memory order",
    per_thread="a V-element chunk of each half x 1-4 heads per step",
    access="16 B (widest that divides R/2 and every stride)",
)

SPECS = [
    ImplSpec(name="fastrope.rope", prepare=_preparer(), check=_table_check,
             summary="fastrope: given cos/sin ([L, R/2] when symmetric), q and k in one launch",
             math="fp32 (Kahan for fp32 out), table chunk loaded once per token, reused by heads",
             **_COMMON),
    ImplSpec(name="fastrope.rope_computed", prepare=_preparer(computed=True),
             summary="fastrope: angles computed once per token in fp64",
             table_source="computed", angle_rel_err=ANGLE_REL_ERR_FP64,
             math="fp64 pos*inv_freq and sincos once per token into shared memory, fp32 rotation",
             **dict(_COMMON, asymmetric_tables=False)),
    ImplSpec(name="fastrope.rope_inplace", prepare=_preparer(in_place=True), check=_table_check,
             summary="fastrope in place (apply_rope_inplace)",
             math="fp32 (Kahan for fp32 out), table chunk loaded once per token, reused by heads",
             **_COMMON),
]


def _ablation(name: str, summary: str, computed: bool = False, full_tables: bool = False,
              **spec_kw):
    """The registry row ``fastrope-ablation.<name>``: ablation.ABLATIONS[name] (full_tables: the
    design given full-width tables)."""
    base = dict(_COMMON, kind="ablation", family="fastrope-ablation",
                math="the design with one idea switched off")
    if computed:
        base.update(table_source="computed", asymmetric_tables=False,
                    angle_rel_err=ANGLE_REL_ERR_FP64)
    base.update(spec_kw)
    return ImplSpec(name=f"fastrope-ablation.{name}", summary=summary,
                    prepare=_preparer(computed=computed,
                                      ablation=None if full_tables else name,
                                      full_tables=full_tables),
                    check=None if computed else _table_check, **base)


def _ablations() -> list[ImplSpec]:
    return [
        _ablation("full_tables", "given the full-width [L, R] tables (both halves of every "
                  "row read) where half-width ones would do", full_tables=True),
        _ablation("scalar_access", "one element per access (no 16-byte vectors)",
                  access="2-4 B"),
        _ablation("one_half_per_thread", "rotate-half out of place: a thread owns one half and "
                  "loads its partner"),
        _ablation("table_per_head", "cos/sin loaded again for every head"),
        _ablation("one_head_per_step", "one head per thread per step (no unrolled loads)"),
        _ablation("wide_steps_past_l2", "past the L2: 16-byte accesses and 4 heads per step "
                  "(16-bit: twice the registers, half the resident blocks; fp32 in place: 88 "
                  "registers, not 70) instead of the plan's 8 and 2 or 4 (16-bit) and 2 (fp32 "
                  "in place)"),
        _ablation("fixed_launch", "the prefill launch shape for every size (no head splits)"),
        _ablation("divmod_index", "indices from a flat id with div/mod per head"),
        _ablation("no_cache_hints", "plain loads/stores (no evict-first streaming hints)"),
        _ablation("int64_index", "64-bit offsets even when 32-bit fit"),
        _ablation("no_step_kernel", "small and mid-sized problems (a decode step, an L2-sized "
                  "prefill) take the main kernel, not the step kernel"),
        _ablation("runtime_switches", "the step kernel reads the position form, id width, "
                  "table width and direction at run time"),
        _ablation("separate_launches", "q and k in two launches"),
        _ablation("sequence_per_block_row", "sbhd: the grid walks each sequence in turn, not "
                  "the tokens in memory order"),
        _ablation("fp32_angles", "computed angles in fp32 (fp32 product, sincosf)",
                  computed=True, angle_rel_err=ANGLE_REL_ERR_FP32_ANGLE),
    ]


ABLATION_SPECS = _ablations()
SPECS = SPECS + ABLATION_SPECS

__all__ = ["ABLATION_SPECS", "SPECS"]
