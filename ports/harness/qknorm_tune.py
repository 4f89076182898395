"""The fused QK-norm's launch constants timed on the GPU at hand, for ``python -m
ports.harness.tune --qknorm`` (which writes the winners as the ``qknorm`` entry of the GPU
family's tuning table).

The constants are :data:`ports.fastrope.qknorm.DEVICE_TUNED`. Each candidate is timed against the
module's own values (what a GPU without a table runs) on the qknorm suite's Qwen3-8B shapes
(:data:`SHAPES`, bf16, the suite's inputs: the ``[L, R/2]`` tables its fastrope rows get,
:func:`ports.harness.qknorm_bench.fastrope_tables`), each direction on its own:

* ``fused QK-norm forward``: ``HEAD_FWD_BLOCK_ELEMENTS`` and ``HEAD_FWD_WARPS``, out of place and
  in place (two cases a shape);
* ``fused QK-norm backward``: ``BACKWARD_PROGRAMS_PER_SM``, the backward alone
  (``ports._adapters.backward_alone``; one case a shape);
* ``fused QK-norm token forward``: ``TOKEN_FWD_QK_TOGETHER`` and ``TOKEN_FWD_ELEMENTS_PER_WARP``,
  OLMo2's norm over all heads of a token (``norm="token"``, ``[heads * d]`` weights), out of
  place and in place.

A candidate's results are first checked against the own values' (one bf16 ulp; the weight
gradients to one ulp of their largest element): a candidate that computes something else is an
error, not a row. Times are CUDA-graph medians, the candidates of a case interleaved in each
round; a candidate's ratio on a case is the median over rounds of its time over the own values'
in the same round. The measurements have the plan rows' form (``row``, ``alternative``,
``case``, ``ratio``, ...), so :func:`ports.harness.tune.choose` decides them alike.
"""
from __future__ import annotations

import contextlib

import torch

from ports.fastrope import qknorm
from ports.harness.timing import backward_alone

FORWARD = "fused QK-norm forward"
BACKWARD = "fused QK-norm backward"
TOKEN_FORWARD = "fused QK-norm token forward"
# (block elements, warps): one to four warps, 4 to 32 elements a thread; the H100 took 512 on one
# warp, the H200 1024 on one warp (tools/qknorm_launch_sweep.py swept wider).
FORWARD_SETTINGS = ((512, 1), (1024, 1), (1024, 2), (2048, 2), (2048, 4))
# programs per SM of the backward's grid: the H100 took 3, the H200 4.
BACKWARD_SETTINGS = (2, 3, 4, 5, 6)
# (q and k together, elements a warp): Qwen3-8B's 32 + 8 heads of 128 together on one, two or four
# warps (4096, 2048, 1024), apart on one or two (q's 32 heads); from the suite's half-width
# tables the H100 took together on two (the module's), the H200 apart on two (q's 32 heads).
TOKEN_FORWARD_SETTINGS = ((1, 1024), (1, 2048), (1, 4096), (0, 2048), (0, 4096))
SHAPES = ("qwen3-8b prefill 4k", "qwen3-8b train 4x4k", "qwen3-8b prefill 32k")


def candidates() -> dict[str, dict[str, dict[str, int]]]:
    """Row -> alternative's name -> the constants it sets, the module's own values left out."""
    own = own_values()
    rows = {
        FORWARD: [dict(HEAD_FWD_BLOCK_ELEMENTS=e, HEAD_FWD_WARPS=w) for e, w in FORWARD_SETTINGS],
        BACKWARD: [dict(BACKWARD_PROGRAMS_PER_SM=p) for p in BACKWARD_SETTINGS],
        TOKEN_FORWARD: [dict(TOKEN_FWD_QK_TOGETHER=t, TOKEN_FWD_ELEMENTS_PER_WARP=e)
                        for t, e in TOKEN_FORWARD_SETTINGS],
    }
    return {row: {name(c): c for c in cs if any(own[k] != v for k, v in c.items())}
            for row, cs in rows.items()}


def name(constants: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in constants.items())


def own_values() -> dict[str, int]:
    """The module's values of DEVICE_TUNED: what a GPU without a table runs."""
    return {k: getattr(qknorm, k) for k in qknorm.DEVICE_TUNED}


@contextlib.contextmanager
def forced(constants: dict[str, int]):
    """qknorm.FORCED set to ``constants`` over the module's own values (restored after)."""
    saved = dict(qknorm.FORCED)
    qknorm.FORCED.clear()
    qknorm.FORCED.update(own_values(), **constants)
    try:
        yield
    finally:
        qknorm.FORCED.clear()
        qknorm.FORCED.update(saved)


def _under(constants: dict[str, int], fn):
    def call():
        with forced(constants):
            return fn()
    call.capture_stream = getattr(fn, "capture_stream", None)  # a backward alone's
    return call


def check_same_answer(results, ref, weights: int, label: str) -> None:
    """``results`` within one bf16 ulp (2^-7 relative) of ``ref``, the last ``weights`` tensors
    (weight gradients, summed in another order) to one ulp of their largest element; else a
    RuntimeError naming ``label`` (``ref``: the reference setting's results). The QK-norm's
    launch settings change the order of its sums, not its answer."""
    for i, (r, e) in enumerate(zip(results, ref)):
        r, e = r.float(), e.float()
        floor = 2**-7 * float(e.abs().max()) if i >= len(ref) - weights else 2**-8
        try:
            torch.testing.assert_close(r, e, rtol=2**-7, atol=floor)
        except AssertionError as err:
            raise RuntimeError(f"{label} computes another answer than the reference setting "
                               f"(output {i}): {str(err).splitlines()[0]}") from None


def _cases(shape, row: str):
    """Case label -> (the call to time: a forward, or the backward alone; the call whose results
    are checked: the timed call, or for in place one that restores the inputs first)."""
    from ports.harness import qknorm_bench as bench

    backward = row == BACKWARD
    norm = "token" if row == TOKEN_FORWARD else "head"
    q, k, qw, kw, cos, sin = bench.inputs(shape, torch.bfloat16, grad=backward, norm=norm)
    cos, sin = bench.fastrope_tables(cos, sin)  # the suite's fastrope rows' tables
    kwargs = dict(cos=cos, sin=sin, gemma=shape.gemma, norm=norm)

    def out():
        return qknorm.qk_norm_rope(q, k, qw, kw, bench.EPS, **kwargs)

    if not backward:
        qi, ki = q.clone(), k.clone()

        def inplace():
            return qknorm.qk_norm_rope_inplace(qi, ki, qw, kw, bench.EPS, **kwargs)

        def inplace_fresh():
            qi.copy_(q)
            ki.copy_(k)
            inplace()
            return qi.clone(), ki.clone()

        return {f"{shape.name} out of place": (out, out),
                f"{shape.name} in place": (inplace, inplace_fresh)}
    gen = torch.Generator(device=q.device).manual_seed(1)
    with forced({}):
        grads = [torch.randn(o.shape, device=q.device, generator=gen).to(o.dtype)
                 for o in out()]
        backward_only = backward_alone(out, (q, k, qw, kw), grads)
    return {shape.name: (backward_only, backward_only)}


def measure(rounds: int, rep_ms: int, progress=lambda m: None, shapes=None) -> list[dict]:
    """Every (row, alternative, case) ratio against the module's own values, on ``shapes``
    (qknorm suite shape names; default :data:`SHAPES`)."""
    from ports.harness import qknorm_bench as bench
    from ports.harness.timing import graph_median_us, paired_summary

    known = {s.name: s for s in bench.SHAPES}
    measurements = []
    for row, alternatives in candidates().items():
        for shape_name in SHAPES if shapes is None else shapes:
            weights = 2 if row == BACKWARD else 0  # dq_weight and dk_weight
            for case, (fn, result) in _cases(known[shape_name], row).items():
                own = _under({}, fn)
                ref = _under({}, result)()
                calls = {}
                for alt, constants in alternatives.items():
                    check_same_answer(_under(constants, result)(), ref, weights,
                                      f"{row}: {alt} at {case}")
                    calls[alt] = _under(constants, fn)
                pairs: dict[str, list[tuple[float, float]]] = {a: [] for a in calls}
                for _ in range(rounds):
                    for alt, call in calls.items():
                        pairs[alt].append((graph_median_us(own, rep_ms=rep_ms),
                                           graph_median_us(call, rep_ms=rep_ms)))
                for alt, ps in pairs.items():
                    entry = dict(row=row, alternative=alt, case=case, same_plan=False,
                                 **paired_summary(ps))
                    measurements.append(entry)
                    progress(entry)
                del calls, ref
                torch.cuda.empty_cache()
    return measurements


def constants_of(choices: dict[str, str]) -> dict[str, int]:
    """The table's ``qknorm`` entry from the rows' choices: every DEVICE_TUNED constant, the
    chosen alternatives' values over the module's own."""
    out = own_values()
    names = candidates()
    for row, alternative in choices.items():
        out.update(names[row][alternative])
    return out
