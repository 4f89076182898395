"""qk_norm_rope's launch settings swept on the qknorm suite's shapes (needs a GPU).

For each shape (bf16, Qwen3's per-head norm; the suite's inputs, fastrope from the ``[L, R/2]``
tables its suite rows get) each setting of the module's launch constants is timed, beside
torch.compile of the unfused pair (the suite's row, a fresh compile cache per shape) and a copy of
the bytes the direction moves. The forward sweeps ``HEAD_FWD_BLOCK_ELEMENTS`` (heads per program *
head_dim) and ``HEAD_FWD_WARPS``, 4 to 64 elements a thread, out of place and in place (q and k
read and written); the backward sweeps the 16-bit full-rotary ``HEAD_BWD_BLOCK_ELEMENTS``,
``BACKWARD_WARPS``, ``BACKWARD_PROGRAMS_PER_SM`` (the grid's budget, which sets the tokens a
program), ``BACKWARD_STAGES`` (the token loop's software-pipelining stages, for every head width)
and ``WEIGHT_GRAD_PDL`` (the weight-gradient reduction as the backward's programmatic dependent),
the backward timed alone (its forward run once, on the stream its graph is captured on; dy, q and k
read, dq and dk written). CUDA-graph us, the minimum of 3 interleaved medians. Each setting's
results are checked against the GPU's default's first: dq, dk and the outputs to one bf16 ulp (the
sum of squares' order follows the block), the weight gradients to one bf16 ulp of their largest
element (their sums' order follows the blocks and tokens). This is the lab's wide sweep; the
constants a GPU family's table sets (``DEVICE_TUNED``) are tuned and written by ``python -m
ports.harness.tune --qknorm``. ``--direction token-backward`` sweeps OLMo2's norm over all heads of
a token (``norm="token"``, the per-head weights tiled over the heads, as the suite's row):
``TOKEN_BWD_WHOLE_ELEMENTS`` (0: every token in two passes over blocks of heads),
``TOKEN_BWD_ELEMENTS_PER_WARP``, the tokens a program (``LONG_RUN_TOKENS``) and
``TOKEN_BWD_STAGES``; ``--direction token-forward`` its forward, out of place and in place:
``TOKEN_FWD_WHOLE_ELEMENTS`` (0: two passes over blocks of heads), ``TOKEN_FWD_ELEMENTS_PER_WARP``
and ``TOKEN_FWD_QK_TOGETHER``; ``--direction token-backward-tma`` the backward's whole tokens read
through TMA descriptors: ``TOKEN_BWD_TMA`` (0: plain loads, the token-backward settings),
``TOKEN_BWD_TMA_ELEMENTS_PER_WARP``, ``TOKEN_BWD_TMA_TOKENS`` (the most tokens a program),
``TOKEN_BWD_TMA_STAGES``, ``TOKEN_BWD_TMA_PROGRAMS_PER_SM``, ``TOKEN_BWD_TMA_QK_TOGETHER`` (a
token's q and k in one program) and ``TOKEN_BWD_TMA_PDL``. The token directions have no
torch.compile row. A results data file with ``--json``:

    python -m tools.qknorm_launch_sweep [--direction forward|backward|token-forward|token-backward
                                          |token-backward-tma]
        [--shapes NAME ...] [--json FILE] [--commit SHA]
"""
from __future__ import annotations

import argparse
import contextlib
import itertools

import torch

from ports.fastrope import qknorm
from ports.harness import qknorm_bench as bench
from ports.harness.qknorm_tune import check_same_answer
from ports.harness.timing import backward_alone, copy_us, graph_median_us, min_of_interleaved
from tools._probe_kit import output_arguments, qknorm_shapes, write_requested

SHAPES = ["decode 64 tokens", "qwen3-8b prefill 4k", "qwen3-8b train 4x4k",
          "qwen3-8b prefill 32k"]


def forward_settings() -> list[tuple[int, int]]:
    """(block elements, warps) pairs: 4 to 64 elements a thread."""
    return [(e, w) for e, w in itertools.product((512, 1024, 2048, 4096, 8192), (1, 2, 4, 8, 16))
            if 4 <= e // (32 * w) <= 64]


def backward_settings() -> list[tuple[int, int, int, int, int]]:
    """(block elements, warps, programs per SM, stages, reduction by dependent launch), 8 to 16
    elements a thread: 8 warps and 2 stages, slower than 4 warps and 1 or 3 stages at every
    matched setting on the H100 (e908b9a), are left out."""
    return [(e, w, p, s, 1) for e, w, p, s in itertools.product((512, 1024, 2048), (1, 2, 4),
                                                                (2, 4, 8, 16), (1, 3))
            if 8 <= e // (32 * w) <= 16]


def token_backward_settings() -> list[tuple[int, int, int, int]]:
    """(whole-token elements, elements a warp, tokens a program, stages): the two-pass kernel
    (0) at its settings, and whole tokens on 4 to 16 warps (32 heads of 128), 8 to 32 tokens a
    program, 1 or 2 stages."""
    return [(0, 512, 16, 1)] + [(8192, e, t, s) for e, t, s in itertools.product(
        (256, 512, 1024), (8, 16, 32), (1, 2))]


def token_forward_settings() -> list[tuple[int, int, int]]:
    """(whole-token elements, elements a warp, q and k together): the two-pass kernel (0) at its
    settings, and whole tokens on 2 to 16 warps (32 heads of 128), q and k in one program (1) or
    a program each (0)."""
    return [(0, 512, 1)] + [(8192, e, t) for e in (256, 512, 1024, 2048) for t in (1, 0)]


def token_backward_tma_settings() -> list[tuple[int, int, int, int, int, int, int]]:
    """(TMA, elements a warp, most tokens a program, stages, programs an SM, q and k together,
    reduction by dependent launch through TMA):
    plain loads (0), and TMA on 4 or 8 warps (32 heads of 128), at most 32 to 512 tokens a
    program, 2 to 4 stages, q and k apart on 2 programs an SM (a q and a k); 4 warps, 3 stages, 4
    or 8 programs an SM apart; and q and k together, 2 to 4 programs an SM."""
    return [(0, 1024, 32, 3, 2, 0, 0)] + [(1, e, t, s, 2, 0, 0) for e, t, s in itertools.product(
        (512, 1024), (32, 128, 512), (2, 3, 4))] + [(1, 1024, 512, 3, p, 0, 0) for p in (4, 8)] + [
        (1, 1024, 512, 3, p, 1, 0) for p in (2, 3, 4)]


_TOKEN_CONSTANTS = {
    "token-forward": ("TOKEN_FWD_WHOLE_ELEMENTS", "TOKEN_FWD_ELEMENTS_PER_WARP",
                      "TOKEN_FWD_QK_TOGETHER"),
    "token-backward": ("TOKEN_BWD_WHOLE_ELEMENTS", "TOKEN_BWD_ELEMENTS_PER_WARP",
                       "LONG_RUN_TOKENS", "TOKEN_BWD_STAGES"),
    "token-backward-tma": ("TOKEN_BWD_TMA", "TOKEN_BWD_TMA_ELEMENTS_PER_WARP",
                           "TOKEN_BWD_TMA_TOKENS", "TOKEN_BWD_TMA_STAGES",
                           "TOKEN_BWD_TMA_PROGRAMS_PER_SM", "TOKEN_BWD_TMA_QK_TOGETHER",
                           "TOKEN_BWD_TMA_PDL")}


@contextlib.contextmanager
def launch_settings(direction: str, setting: tuple[int, ...]):
    """The module's launch constants set to ``setting`` for ``direction`` (restored after)."""
    if direction in _TOKEN_CONSTANTS:
        names = _TOKEN_CONSTANTS[direction]
        saved = [getattr(qknorm, name) for name in names]
        forced = dict(qknorm.FORCED)
        for name, value, old in zip(names, setting, saved):
            # a constant kept by element size: the sweep's (bf16) entry
            setattr(qknorm, name, {**old, 2: value} if isinstance(old, dict) else value)
            if name in qknorm.DEVICE_TUNED:  # over the device family's table
                qknorm.FORCED[name] = value
        try:
            yield
        finally:
            for name, value in zip(names, saved):
                setattr(qknorm, name, value)
            qknorm.FORCED.clear()
            qknorm.FORCED.update(forced)
        return
    forced = dict(qknorm.FORCED)
    saved = (qknorm.HEAD_FWD_BLOCK_ELEMENTS, qknorm.HEAD_FWD_WARPS,
             dict(qknorm.HEAD_BWD_BLOCK_ELEMENTS), qknorm.BACKWARD_WARPS,
             qknorm.BACKWARD_PROGRAMS_PER_SM, qknorm.BACKWARD_STAGES,
             qknorm.PIPELINED_MAX_HEAD_DIM, qknorm.WEIGHT_GRAD_PDL)
    if direction == "forward":
        qknorm.HEAD_FWD_BLOCK_ELEMENTS, qknorm.HEAD_FWD_WARPS = setting
        qknorm.FORCED.update(HEAD_FWD_BLOCK_ELEMENTS=setting[0], HEAD_FWD_WARPS=setting[1])
    else:
        qknorm.FORCED["BACKWARD_PROGRAMS_PER_SM"] = setting[2]
        qknorm.HEAD_BWD_BLOCK_ELEMENTS = {**saved[2], (2, False): setting[0]}
        (qknorm.BACKWARD_WARPS, qknorm.BACKWARD_PROGRAMS_PER_SM,
         qknorm.BACKWARD_STAGES) = setting[1:4]
        qknorm.WEIGHT_GRAD_PDL = bool(setting[4])
        qknorm.PIPELINED_MAX_HEAD_DIM = qknorm.MAX_HEAD_DIM  # the stages swept apply to any head
    try:
        yield
    finally:
        qknorm.FORCED.clear()
        qknorm.FORCED.update(forced)
        (qknorm.HEAD_FWD_BLOCK_ELEMENTS, qknorm.HEAD_FWD_WARPS, qknorm.HEAD_BWD_BLOCK_ELEMENTS,
         qknorm.BACKWARD_WARPS, qknorm.BACKWARD_PROGRAMS_PER_SM, qknorm.BACKWARD_STAGES,
         qknorm.PIPELINED_MAX_HEAD_DIM, qknorm.WEIGHT_GRAD_PDL) = saved


def default_setting(direction: str) -> tuple[int, ...]:
    """The direction's setting on this GPU (its family's tuning table over the module's)."""
    device = torch.device("cuda", torch.cuda.current_device())
    if direction in _TOKEN_CONSTANTS:
        return tuple(qknorm.launch_constant(name, device) if name in qknorm.DEVICE_TUNED
                     else int(getattr(qknorm, name)) if name.endswith("_PDL")
                     else getattr(qknorm, name) for name in _TOKEN_CONSTANTS[direction])
    if direction == "forward":
        return (qknorm.launch_constant("HEAD_FWD_BLOCK_ELEMENTS", device),
                qknorm.launch_constant("HEAD_FWD_WARPS", device))
    return (qknorm.HEAD_BWD_BLOCK_ELEMENTS[2, False], qknorm.BACKWARD_WARPS,
            qknorm.launch_constant("BACKWARD_PROGRAMS_PER_SM", device), qknorm.BACKWARD_STAGES,
            int(qknorm.WEIGHT_GRAD_PDL))


def _under(direction, setting, fn):
    def call():
        with launch_settings(direction, setting):
            return fn()
    call.capture_stream = getattr(fn, "capture_stream", None)  # a backward alone's
    return call


def sweep(shape, direction: str, settings: list[tuple[int, ...]]
          ) -> tuple[list[list[str]], float, float]:
    """(rows, copy us, compiled unfused us) of one shape in one direction."""
    backward = "backward" in direction
    token = direction in _TOKEN_CONSTANTS
    norm = "token" if token else "head"  # token: [heads * d] weights, as the suite's row
    q, k, qw, kw, cos, sin = bench.inputs(shape, torch.bfloat16, grad=backward, norm=norm)
    eps = bench.EPS
    # fastrope from the suite's [L, R/2] tables; torch.compile from transformers' full rows
    half_cos, half_sin = bench.fastrope_tables(cos, sin)
    norm_kwargs = dict(cos=half_cos, sin=half_sin, gemma=shape.gemma, norm=norm)

    def fwd():
        return qknorm.qk_norm_rope(q, k, qw, kw, eps, **norm_kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(bench.unfused, fullgraph=True)
    tables = cos[:shape.s], sin[:shape.s]

    def fwd_compiled():
        return compiled(q, k, qw, kw, *tables, shape.gemma)

    calls = {}
    if backward:
        gen = torch.Generator(device="cuda").manual_seed(1)
        grads = [torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype) for o in fwd()]

        backward_only = backward_alone(fwd, (q, k, qw, kw), grads)
        ref = backward_only()
        for s in settings:
            check_same_answer(_under(direction, s, backward_only)(), ref, 2, f"{shape.name} {s}")
            calls[s, "bwd"] = _under(direction, s, backward_only)
        if not token:  # on leaves of its own: backward_alone's leaves serve one forward
            leaves = [x.detach().requires_grad_(True) for x in (q, k, qw, kw)]
            calls["compiled"] = backward_alone(
                lambda: compiled(*leaves, *tables, shape.gemma), leaves, grads)
        moved = 3 * (q.numel() + k.numel()) * q.element_size() // 2  # copy_us moves 2x this
    else:
        qi, ki = q.clone(), k.clone()
        ref = fwd()
        for s in settings:
            check_same_answer(_under(direction, s, fwd)(), ref, 0, f"{shape.name} {s}")
            calls[s, "out"] = _under(direction, s, fwd)
            calls[s, "in"] = _under(direction, s, lambda: qknorm.qk_norm_rope_inplace(
                qi, ki, qw, kw, eps, **norm_kwargs))
        if not token:
            calls["compiled"] = fwd_compiled
        moved = (q.numel() + k.numel()) * q.element_size()
    for f in calls.values():
        f()  # compile, autotune outside the capture
    us = min_of_interleaved(calls, timer=lambda f: graph_median_us(f, rep_ms=40))
    copy = copy_us(moved, graph=True)

    def pct(t):
        return f"{100 * copy / t:.0f}%"

    rows = []
    for s in settings:
        times = [us[s, "bwd"]] if backward else [us[s, "out"], us[s, "in"]]
        rows.append([shape.name, *map(str, s)] + [c for t in times for c in (f"{t:.1f}", pct(t))])
    compiled_us = None if token else us["compiled"]
    return rows, copy, compiled_us


COLUMNS = {"forward": ["shape", "block elements", "warps", "out of place (us)", "% copy",
                       "in place (us)", "% copy"],
           "backward": ["shape", "block elements", "warps", "programs per SM", "stages",
                        "reduction by dependent launch", "backward (us)", "% copy"],
           "token-forward": ["shape", "whole-token elements", "elements a warp",
                             "q and k together", "out of place (us)", "% copy", "in place (us)",
                             "% copy"],
           "token-backward": ["shape", "whole-token elements", "elements a warp",
                              "tokens a program", "stages", "backward (us)", "% copy"],
           "token-backward-tma": ["shape", "TMA", "elements a warp", "most tokens a program",
                                  "stages", "programs an SM", "q and k together",
                                  "reduction by dependent launch", "backward (us)", "% copy"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.qknorm_launch_sweep",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--direction", choices=tuple(COLUMNS), default="forward")
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--settings", nargs="*", metavar="A,B,...",
                    help="time only these settings (the direction's tuple as comma-separated "
                         "ints); default: the direction's whole sweep")
    output_arguments(ap)
    args = ap.parse_args(argv)
    shapes = qknorm_shapes(ap, args.shapes)
    default = default_setting(args.direction)
    settings = {"forward": forward_settings, "backward": backward_settings,
                "token-forward": token_forward_settings,
                "token-backward": token_backward_settings,
                "token-backward-tma": token_backward_tma_settings}[args.direction]()
    if args.settings:
        try:
            settings = [tuple(int(v) for v in t.split(",")) for t in args.settings]
        except ValueError:
            ap.error(f"--settings takes comma-separated ints, got {args.settings}")
        if any(len(t) != len(default) for t in settings):
            ap.error(f"a {args.direction} setting has {len(default)} ints, like {default}")
    rows, notes = [], []
    for shape in shapes:
        shape_rows, copy, compiled = sweep(shape, args.direction, settings)
        rows += shape_rows
        notes.append(f"{shape.name}: copy {copy:.1f} us" + (
            "" if compiled is None else f", torch.compile of the unfused pair {compiled:.1f} us"))
        print("\n".join(" | ".join(r) for r in shape_rows), f"\n{notes[-1]}", flush=True)
    write_requested(args, argv, tool="tools.qknorm_launch_sweep", doc=__doc__,
                    section=f"qk_norm_rope's {args.direction} launch settings",
                    columns=COLUMNS[args.direction], rows=rows,
                    more_context=(f" The {args.direction}'s setting on this GPU at the time: "
                                  f"{default}. " + "; ".join(notes) + "."))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
