"""The ``qknorm`` suite: fused per-head QK-norm + RoPE against its peers and the unfused pairs,
forward and backward, on equal inputs, on the GPU.

    python -m ports.harness.qknorm_bench [--dtype bf16] [--rep-ms 100] [--shapes NAME..]
                                         [--check] [--json PATH] [--set BACKWARD_WARPS=8 ...]

Rows, per shape and direction, in us: the median of CUDA-graph replays, the fastest of
``ROUNDS`` rounds interleaved across the direction's rows, the copy timed the same way. A
backward is timed alone: the forward runs once, outside the graph, on the stream the
backward's graph is captured on (autograd runs a backward on its forward's stream), and the
graph replays ``torch.autograd.grad`` (``ports._adapters.backward_alone``); so it is the GPU
time of the backward's kernels, not the host time of autograd's engine. Every row
gets the same q, k ``[b, s, h, d]``, weights and cos/sin values (seed 0); a row whose API takes
another form gets it built outside the timed call, and the table's ``input`` column says which:

* ``fastrope fused``: :func:`ports.fastrope.qknorm.qk_norm_rope` (forward, backward), with
  the ``[L, R/2]`` tables its API takes for rotate-half (one angle per pair: the first half of
  the full-width rows), the angles vLLM's cache holds; the other fastrope rows take them too;
* ``vllm_port fused (fwd only)``: vLLM's ``fused_qk_norm_rope``
  (:mod:`ports.vllm_port.qknorm`), forward only as upstream, in place on a packed
  ``qkv [b*s, (hq + 2 hk) * d]`` (its API: v's heads ride along untouched) with its
  ``cat(cos, sin)`` cache and int64 positions; only the kernel is timed (positions trusted);
* ``fastrope fused token-norm``: ``qk_norm_rope(..., norm="token")``, OLMo2's norm over all
  heads of a token, with ``[heads * d]`` weights (the per-head weight's values tiled over the
  heads, made with the inputs, outside the timed calls) (forward, backward): the function
  FlashInfer's kernel computes, for comparison with its row;
* ``flashinfer_port token-norm (fwd only)``: FlashInfer's ``fused_qk_rmsnorm_rope``
  (:mod:`ports.flashinfer_port.qknorm`), its only fused QK-norm + RoPE: a video-diffusion kernel
  whose norm spans all heads of a token (OLMo2's form, not Qwen3's), so it gets the same
  ``[heads * d]`` weights and is checked against the oracle of *that* norm; bf16 only;
  packed qkv in, separate q, k and v out (it copies v: its bytes are (q + k + v) x 2, while
  ``% copy`` counts q and k only); 1-D RoPE as its 3-D form with ``pph = ppw = 1``, angles
  computed in the kernel (``__sincosf``); outputs preallocated, only the kernel timed;
* ``compiled unfused``: ``torch.compile(fullgraph=True)`` of transformers' norm then its
  rotate-half RoPE (what a user gets today by compiling the model; forward, backward), on
  transformers' full-width ``[L, R]`` rows, as ``hf eager``;
* ``compiled unfused token-norm``: the same for OLMo2's norm over a token's heads, with the
  ``[heads * d]`` weights (the token-norm rows' compiled counterpart);
* ``hf eager``: the same two steps in eager PyTorch;
* ``rms_norm + fastrope``: fastrope's own unfused pair, ``torch.nn.functional.rms_norm`` (one
  RMSNorm kernel per tensor) then ``fastrope.apply_rope`` (one RoPE launch for q and k);
* ``hf eager + fastrope``: transformers' RMSNorm formula in eager PyTorch, then fastrope;
* ``copy``: a device-to-device copy moving the bytes the fused kernel must move: forward, read q
  and k and write them (2 x (q + k) bytes); backward, read dy and the saved x of q and k and
  write dq and dk (3 x (q + k) bytes; the weight-gradient partials add 2 x 4 x d bytes a program).

``% copy`` is the copy's time over the row's time (100% = at the copy ceiling); ``x unfused``
is the ``rms_norm + fastrope`` time over the row's. Backward rows time ``torch.autograd.grad``
of the outputs with respect to q, k and the two weights.

``--check`` first runs every row once and compares its outputs (forward: q and k; backward: dq
and dk) with the float64 oracle of norm then RoPE (:mod:`reference.qk_norm`, on the GPU); the
``err`` column gives the largest error in units of the output dtype's spacing at the
reference's largest magnitude (ulp). A row beyond ``WRONG_ULPS`` (or with a NaN) is not timed:
its cell says so. ``--json PATH`` writes the table as a results data file (columns and rows as
quoted, with GPU, versions, commit, date and command; the raw measurements beside them); an
existing file from the same dtype keeps its rows of shapes not run now, so several runs (one
per group of shapes) fill one file.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from ports.harness.timing import backward_alone


EPS = 1e-6
WRONG_ULPS = 64.0  # the check's bound: beyond this many output ulps a row is wrong, not rough
# Timing rounds, interleaved across a direction's rows: each row keeps its fastest round, so a
# clock or neighbour drift during one row's timing moves every row alike (as in the launch sweep
# and the tuning). Not the cause of the gap between the suite's and the sweep's H100 forward at
# Qwen3-8B's 4 x 4k tokens: 119.4 us with one median, 119.7 with rounds, 112.1 in the sweep
# (results/README.md, 2026-11-27).
ROUNDS = 3


@dataclass(frozen=True)
class Shape:
    name: str
    b: int
    s: int
    hq: int
    hk: int
    d: int
    gemma: bool = False


# Qwen3-8B's attention (32 q / 8 kv heads of 128) at decode and prefill token counts up to 32k,
# Qwen3-0.6B's (16 / 8), and Gemma3's head of 256 with its (1 + w) weight.
SHAPES = [
    Shape("decode 1 token", 1, 1, 32, 8, 128),
    Shape("decode 64 tokens", 64, 1, 32, 8, 128),
    Shape("qwen3-8b prefill 1k", 1, 1024, 32, 8, 128),
    Shape("qwen3-8b prefill 4k", 1, 4096, 32, 8, 128),
    Shape("qwen3-8b train 4x4k", 4, 4096, 32, 8, 128),
    Shape("qwen3-8b prefill 32k", 1, 32768, 32, 8, 128),
    Shape("qwen3-0.6b 16k", 1, 16384, 16, 8, 128),
    Shape("gemma3 8k (d 256)", 1, 8192, 8, 4, 256, gemma=True),
]

Q_K = "q, k [b, s, h, d]"
HALF_TABLES = "; cos, sin [L, R/2]"  # fastrope's rows: one angle per pair
PACKED = "packed qkv [b*s, (hq+2hk)*d], in place"
PACKED_OUT = "packed qkv in; q, k, v out (v copied); norm over all heads"


def _hf_norm(x, w, eps, gemma):
    """transformers' RMSNorm: Qwen3's (round, then weight) or Gemma3's ((x_hat (1 + w)).to)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (xf * (1.0 + w.float())).to(x.dtype)
    return w * xf.to(x.dtype)


def _hf_rope(x, cos, sin):
    """transformers' ``q * cos + rotate_half(q) * sin``; cos/sin ``[s, d]``, x ``[b, s, h, d]``."""
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def unfused(q, k, qw, kw, cos, sin, gemma):
    """transformers' per-head RMSNorm of q and k, then its RoPE (the eager and compiled rows)."""
    qn, kn = _hf_norm(q, qw, EPS, gemma), _hf_norm(k, kw, EPS, gemma)
    return _hf_rope(qn, cos, sin), _hf_rope(kn, cos, sin)


def unfused_token(q, k, qw, kw, cos, sin, gemma):
    """OLMo2's form: transformers' RMSNorm over each token's heads at once (``[heads * d]``
    weights), then its RoPE per head (the compiled token-norm row)."""
    def norm(x, w):
        b, s, h, d = x.shape
        return _hf_norm(x.reshape(b, s, h * d), w, EPS, gemma).view(b, s, h, d)
    return _hf_rope(norm(q, qw), cos, sin), _hf_rope(norm(k, kw), cos, sin)


# ---- the packed-qkv peers' inputs, built outside the timed call ------------------------------
def packed_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[b*s, (hq + hk + hv) * d]``, contiguous: each token's q heads, then k's, then v's (what a
    fused QKV projection writes)."""
    b, s = q.shape[:2]
    return torch.cat([t.reshape(b * s, -1) for t in (q, k, v)], dim=-1).contiguous()


def unpack_qk(qkv: torch.Tensor, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of q and k ``[b, s, h, d]`` inside a packed qkv."""
    q = qkv[:, : shape.hq * shape.d]
    k = qkv[:, shape.hq * shape.d: (shape.hq + shape.hk) * shape.d]
    return (q.reshape(shape.b, shape.s, shape.hq, shape.d),
            k.reshape(shape.b, shape.s, shape.hk, shape.d))


def cat_cos_sin_cache(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """vLLM's ``cos_sin_cache`` ``[L, R]`` from rotate-half full-width tables: each row the cos
    half then the sin half (the same values the other rows read)."""
    return torch.cat(fastrope_tables(cos, sin), dim=-1).contiguous()


@dataclass
class Row:
    """One implementation: ``prepare(q, k, qw, kw, cos, sin)`` (outside the timed call) returns
    ``run``, which computes and returns ``(q_out, k_out)``; ``backward`` False: forward only."""

    name: str
    input: str
    prepare: object
    backward: bool = True
    refuses: object = None  # (Shape, dtype) -> reason or None
    norm: str = "head"      # the oracle it is checked against (reference.qk_norm.NORMS)


def _rows(shape: Shape) -> list[Row]:
    from ports.fastrope import apply_rope
    from ports.fastrope.qknorm import qk_norm_rope

    s, gemma = shape.s, shape.gemma

    def direct(fn):
        return lambda q, k, qw, kw, cos, sin: (lambda: fn(q, k, qw, kw, cos, sin))

    def half_tables(fn):
        """fastrope's rows: :func:`fastrope_tables` (made outside the timed call)."""
        def prepare(q, k, qw, kw, cos, sin):
            hc, hs = fastrope_tables(cos, sin)
            return lambda: fn(q, k, qw, kw, hc, hs)
        return prepare

    def fused(q, k, qw, kw, cos, sin):
        return qk_norm_rope(q, k, qw, kw, EPS, cos=cos, sin=sin, gemma=gemma)

    def fused_token(q, k, qw, kw, cos, sin):  # [heads * d] weights (inputs(norm="token"))
        return qk_norm_rope(q, k, qw, kw, EPS, cos=cos, sin=sin, gemma=gemma, norm="token")

    def rms_norm_fastrope(q, k, qw, kw, cos, sin):
        d = q.shape[-1]
        wq, wk = (1.0 + qw, 1.0 + kw) if gemma else (qw, kw)
        qn = torch.nn.functional.rms_norm(q, (d,), wq.to(q.dtype), EPS)
        kn = torch.nn.functional.rms_norm(k, (d,), wk.to(k.dtype), EPS)
        return apply_rope(qn, kn, cos=cos, sin=sin, check_positions=False)

    def hf_fastrope(q, k, qw, kw, cos, sin):
        return apply_rope(_hf_norm(q, qw, EPS, gemma), _hf_norm(k, kw, EPS, gemma),
                          cos=cos, sin=sin, check_positions=False)

    def hf_eager(q, k, qw, kw, cos, sin):
        return unfused(q, k, qw, kw, cos[:s], sin[:s], gemma)

    compiled = torch.compile(unfused, fullgraph=True)

    def compiled_unfused(q, k, qw, kw, cos, sin):
        return compiled(q, k, qw, kw, cos[:s], sin[:s], gemma)

    compiled_token = torch.compile(unfused_token, fullgraph=True)

    def compiled_unfused_token(q, k, qw, kw, cos, sin):
        return compiled_token(q, k, qw, kw, cos[:s], sin[:s], gemma)

    def vllm_prepare(q, k, qw, kw, cos, sin):
        from ports.vllm_port import fused_qk_norm_rope

        v = torch.randn_like(k)
        qkv = packed_qkv(q.detach(), k.detach(), v)
        cache = cat_cos_sin_cache(cos, sin)
        pos = torch.arange(s, device=q.device, dtype=torch.int64).repeat(shape.b)
        qw_, kw_ = qw.detach().to(q.dtype), kw.detach().to(k.dtype)
        fused_qk_norm_rope(qkv, shape.hq, shape.hk, shape.hk, shape.d, EPS, qw_, kw_, cache,
                           True, pos)  # once with the host position check
        qkv.copy_(packed_qkv(q.detach(), k.detach(), v))

        def run():
            fused_qk_norm_rope(qkv, shape.hq, shape.hk, shape.hk, shape.d, EPS, qw_, kw_, cache,
                               True, pos, check_positions_on_host=False)
            return unpack_qk(qkv, shape)
        return run

    def vllm_refuses(sh: Shape, dtype: torch.dtype):
        return "no (1 + w) weight form" if sh.gemma else None

    def flashinfer_prepare(q, k, qw, kw, cos, sin):
        from ports.flashinfer_port import fused_qk_rmsnorm_rope

        v = torch.randn_like(k)
        qkv = packed_qkv(q.detach(), k.detach(), v)
        qw_, kw_ = (w.detach().to(q.dtype).contiguous() for w in (qw, kw))  # [heads * d]
        outs = [torch.empty(shape.b * s, h, shape.d, dtype=q.dtype, device=q.device)
                for h in (shape.hq, shape.hk, shape.hk)]
        kwargs = dict(ppf=s, pph=1, ppw=1, num_frame_channels=shape.d, num_height_channels=0,
                      num_width_channels=0, num_heads_q=shape.hq, num_heads_k=shape.hk,
                      num_heads_v=shape.hk, head_dim=shape.d, eps=EPS, interleave=False,
                      q_out=outs[0], k_out=outs[1], v_out=outs[2])

        def run():
            qo, ko, _ = fused_qk_rmsnorm_rope(qkv, qw_, kw_, **kwargs)
            return (qo.view(shape.b, s, shape.hq, shape.d),
                    ko.view(shape.b, s, shape.hk, shape.d))
        return run

    def flashinfer_refuses(sh: Shape, dtype: torch.dtype):
        if sh.gemma:
            return "no (1 + w) weight form"
        return None if dtype == torch.bfloat16 else "bf16 only"

    return [Row("fastrope fused", Q_K + HALF_TABLES, half_tables(fused)),
            Row("vllm_port fused (fwd only)", PACKED, vllm_prepare, backward=False,
                refuses=vllm_refuses),
            Row("fastrope fused token-norm", Q_K + ", norm over all heads" + HALF_TABLES,
                half_tables(fused_token), norm="token"),
            Row("flashinfer_port token-norm (fwd only)", PACKED_OUT, flashinfer_prepare,
                backward=False, refuses=flashinfer_refuses, norm="token"),
            Row("compiled unfused", Q_K, direct(compiled_unfused)),
            Row("compiled unfused token-norm", Q_K + ", norm over all heads",
                direct(compiled_unfused_token), norm="token"),
            Row("hf eager", Q_K, direct(hf_eager)),
            Row("rms_norm + fastrope", Q_K + HALF_TABLES, half_tables(rms_norm_fastrope)),
            Row("hf eager + fastrope", Q_K + HALF_TABLES, half_tables(hf_fastrope))]


def fastrope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables fastrope's rows get from :func:`inputs`' full-width rotate-half ``cos, sin``:
    their first halves, ``[L, R/2]`` (one angle per pair, the angles vLLM's cache holds). A
    token's full-width fp32 rows are 1 KB at d = 128, 5% of the 20 KB of q and k (32 + 8 heads,
    bf16) its forward reads and writes; half-width rows are 2.5% (results/README.md, "the fused
    QK-norm's bytes: the table rows"). The suite's rows, ``tune --qknorm`` and
    tools/qknorm_launch_sweep.py all time fastrope from these."""
    from reference.tables import first_members

    return tuple(first_members(t, "rotate_half").contiguous() for t in (cos, sin))


def inputs(shape: Shape, dtype: torch.dtype, grad: bool, norm: str = "head"):
    """``(q, k, q_weight, k_weight, cos, sin)`` for ``shape`` on the GPU, seeded; full-width fp32
    tables of ``shape.s`` rows; ``grad``: every tensor but the tables requires grad.
    ``norm="token"``: weights of ``heads * d`` (the per-head weights tiled over the heads, the
    same values), so no row spends time tiling them."""
    from reference.tables import rope_tables

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(shape.b, shape.s, shape.hq, shape.d, device="cuda", generator=g).to(dtype)
    k = torch.randn(shape.b, shape.s, shape.hk, shape.d, device="cuda", generator=g).to(dtype)
    qw = (torch.randn(shape.d, device="cuda", generator=g) * 0.1
          + (0.0 if shape.gemma else 1.0)).to(dtype)
    kw = (torch.randn(shape.d, device="cuda", generator=g) * 0.1
          + (0.0 if shape.gemma else 1.0)).to(dtype)
    if norm == "token":
        qw, kw = qw.repeat(shape.hq), kw.repeat(shape.hk)
    cos, sin = rope_tables(shape.s, shape.d, device="cuda")
    if grad:
        for t in (q, k, qw, kw):
            t.requires_grad_(True)
    return q, k, qw, kw, cos, sin


# ---- the check against the float64 oracle ---------------------------------------------------
def ulps_off(actual: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest ``|actual - ref|`` in units of ``dtype``'s spacing at ``max|ref|`` (inf on NaN)."""
    from reference.tolerances import ulp

    actual = actual.detach().to(torch.float64)
    if actual.isnan().any():
        return float("inf")
    err = float((actual - ref).abs().max()) if ref.numel() else 0.0
    return err / ulp(float(ref.abs().max()) if ref.numel() else 0.0, dtype)


def oracle(shape: Shape, args, direction: str, grads=None, norm: str = "head"):
    """The float64 reference: (q, k) forward; (dq, dk) backward. ``norm="token"``: the norm over
    all heads (``[heads * d]`` weights)."""
    from reference.qk_norm import qk_norm_rope_oracle, qk_norm_rope_oracle_backward

    q, k, qw, kw, cos, sin = args
    pos = torch.arange(shape.s, device=q.device).expand(shape.b, shape.s)
    kw_ = dict(cos_table=cos.double(), sin_table=sin.double(), positions=pos, layout="bshd",
               style="rotate_half", gemma=shape.gemma)
    if direction == "forward":
        return tuple(qk_norm_rope_oracle(x.detach(), w.detach(), EPS, norm=norm, **kw_)
                     for x, w in ((q, qw), (k, kw)))
    return tuple(qk_norm_rope_oracle_backward(x, w, g, EPS, norm=norm, **kw_)[0]
                 for x, w, g in ((q, qw, grads[0]), (k, kw, grads[1])))


def measure(shape: Shape, dtype: torch.dtype, rep_ms: int, *, check: bool = False) -> list[dict]:
    """One row per (direction, implementation), plus the copy rows. A direction's rows (and
    its copy) are prepared first, then timed in ``ROUNDS`` interleaved rounds; each keeps its
    fastest round's median."""
    from ports.harness.timing import copy_of, graph_median_us, min_of_interleaved

    item = torch.empty((), dtype=dtype).element_size()
    qk_bytes = shape.b * shape.s * (shape.hq + shape.hk) * shape.d * item
    # A fresh compile cache per shape: the compiled rows' recompiles (shapes, grad or not) count
    # against one code object's limit, which three shapes' forward and backward exceed.
    torch._dynamo.reset()
    rows = []
    for direction, moved in (("forward", 2 * qk_bytes), ("backward", 3 * qk_bytes)):
        base = dict(shape=shape.name, direction=direction)
        calls = {"copy": copy_of(moved // 2)}  # the timed calls: "copy", (row index, part)
        prepared = []
        for i, row in enumerate(_rows(shape)):
            out = dict(base, impl=row.name, input=row.input, us=None)
            prepared.append(out)
            reason = row.refuses(shape, dtype) if row.refuses else None
            if direction == "backward" and not row.backward:
                reason = "forward only (as upstream)"
            if reason:
                out["reason"] = f"unsupported: {reason}"
                continue
            try:
                calls.update(_prepare(row, i, out, shape, dtype, direction, check))
            except Exception as e:  # a row that cannot run says why, the rest still run
                _failed(out, e, shape, direction)
        failures = {}

        def timer(fn):  # a call that fails in its capture or replay is timed as never finishing
            try:
                return graph_median_us(fn, rep_ms=rep_ms)
            except Exception as e:
                failures.setdefault(fn, e)
                return float("inf")

        us = min_of_interleaved(calls, reps=ROUNDS, timer=timer)
        copy = us.pop("copy")
        rows.append(dict(base, impl="copy", input="", us=copy, copy_us=copy))
        for i, out in enumerate(prepared):
            out["copy_us"] = copy
            parts = {key[1]: t for key, t in us.items() if key[0] == i}
            failed = [failures[calls[(i, p)]] for p in parts if calls[(i, p)] in failures]
            if failed:
                _failed(out, failed[0], shape, direction)
            elif "run" in parts:
                out["us"] = parts["run"]
        rows += prepared
        del calls
        torch.cuda.empty_cache()
    return rows


def _prepare(row, i: int, out: dict, shape: Shape, dtype: torch.dtype, direction: str,
             check: bool) -> dict:
    """Row ``i``'s call to time, keyed ``(i, "run")``: the forward, or the backward alone; none
    for a row that ``check`` finds wrong (``out`` gets its error and the reason)."""
    grad = direction == "backward"
    args = inputs(shape, dtype, grad=grad, norm=row.norm)
    if not grad:
        with torch.no_grad():
            run = row.prepare(*args)
            result = run()  # compile / warm up outside the capture
            if check:
                out["err_ulp"] = max(ulps_off(o, r, dtype) for o, r in
                                     zip(result, oracle(shape, args, direction, norm=row.norm)))
        calls = {(i, "run"): run}
    else:
        run = row.prepare(*args)
        outs = run()
        g = torch.Generator(device="cuda").manual_seed(1)
        grads = [torch.randn(o.shape, device="cuda", generator=g).to(o.dtype) for o in outs]
        del outs  # its graph, and with it the leaves' gradient accumulators
        backward = backward_alone(run, args[:4], grads)
        result = backward()
        if check:
            out["err_ulp"] = max(ulps_off(o, r, dtype) for o, r in
                                 zip(result[:2], oracle(shape, args, direction, grads,
                                                        norm=row.norm)))
        calls = {(i, "run"): backward}
    err = out.get("err_ulp", 0.0)
    if err == float("inf"):  # kept out of the data file (JSON has no infinity)
        out["err_ulp"] = None
        out["reason"] = "wrong: NaN in the output"
        return {}
    if err > WRONG_ULPS:
        out["reason"] = f"wrong: {err:.3g} ulp from the oracle"
        return {}
    return calls


def _failed(out: dict, e: Exception, shape: Shape, direction: str) -> None:
    out["reason"] = f"{type(e).__name__}: {e}"[:80]
    print(f"qknorm_bench: {shape.name} {direction} {out['impl']}: {out['reason']}",
          file=sys.stderr)
    traceback.print_exception(e, file=sys.stderr)

COLUMNS = ["shape", "direction", "implementation", "input", "us", "% copy", "x unfused",
           "err (ulp)"]
ALIGN = ["left", "left", "left", "left", "right", "right", "right", "right"]


def cells(rows: list[dict]) -> list[list[str]]:
    """The table's cells, as strings (one unit: microseconds)."""
    unfused = {(r["shape"], r["direction"]): r["us"] for r in rows
               if r["impl"] == "rms_norm + fastrope"}
    out = []
    for r in rows:
        err = f"{r['err_ulp']:.2f}" if r.get("err_ulp") is not None else ""
        head = [r["shape"], r["direction"], r["impl"], r.get("input", "")]
        if r["us"] is None:
            out.append(head + [r.get("reason", "error"), "", "", err])
            continue
        base = unfused.get((r["shape"], r["direction"]))
        ratio = f"{base / r['us']:.2f}" if base else ""
        out.append(head + [f"{r['us']:.1f}", f"{100 * r['copy_us'] / r['us']:.0f}%", ratio,
                           err])
    return out


def table(rows: list[dict]) -> str:
    """The markdown table (one unit: microseconds)."""
    rule = {"left": "---", "right": "---:"}
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(rule[a] for a in ALIGN) + "|"]
    lines += ["| " + " | ".join(c) + " |" for c in cells(rows)]
    return "\n".join(lines)


def data_file(rows: list[dict], *, dtype: str, command: str, previous: dict | None = None,
              commit: str | None = None) -> dict:
    """A results data file (tools/results_tables.py's form) for ``rows``; ``previous`` (an
    earlier file of the same dtype) keeps its measurements of shapes not in ``rows``; ``commit``
    (default: the checkout's) names the tree measured."""
    from ports.harness.env import driver_version, metadata

    meta = metadata()
    shapes = {r["shape"] for r in rows}
    kept = []
    commands = [command]
    if previous and previous.get("dtype") == dtype:
        kept = [r for r in previous.get("measurements", []) if r["shape"] not in shapes]
        commands = [c for c in previous.get("command", []) if c != command] + commands
    order = {s.name: i for i, s in enumerate(SHAPES)}
    merged = sorted(kept + rows, key=lambda r: (order.get(r["shape"], len(order)),
                                                 r["direction"] != "forward"))
    return {
        "document": "ports/fastrope/DESIGN.md",
        "section": "Fused QK-norm + RoPE",
        "context": (f"The qknorm suite ({dtype}): median us per call from CUDA-graph "
                    f"replays, the fastest of {ROUNDS} rounds interleaved across the rows; "
                    "backward: the backward alone, captured on its forward's stream; "
                    "% copy: a "
                    "copy of the bytes the direction must move over the row's time; x unfused: "
                    "rms_norm + fastrope's time over the row's; err: largest error against the "
                    "float64 oracle in output ulps (empty: run without --check)."),
        "command": commands,
        "commit": commit or meta["git_sha"],
        "gpu": meta["gpu"],
        "driver": driver_version(),
        "versions": {k: meta[k] for k in ("torch", "triton", "cupy", "python")},
        "date": meta["timestamp"][:10],
        "dtype": dtype,
        "columns": COLUMNS,
        "align": ALIGN,
        "rows": cells(merged),
        "measurements": merged,
    }


# Launch settings of ports.fastrope.qknorm that ``--set`` may override (module constants).
TUNABLES = ("HEAD_FWD_BLOCK_ELEMENTS", "HEAD_FWD_WARPS", "TOKEN_FWD_BLOCK_ELEMENTS",
            "TOKEN_FWD_WARPS", "TOKEN_BWD_BLOCK_ELEMENTS", "LONG_RUN_TOKENS",
            "LONG_RUN_MIN_TOKENS", "BACKWARD_WARPS", "BACKWARD_STAGES",
            "BACKWARD_PROGRAMS_PER_SM", "PIPELINED_MAX_HEAD_DIM")


def _settings(pairs: list[str]) -> dict[str, int]:
    """``["NAME=INT", ...]`` as a dict, each name one of TUNABLES and each value a positive int."""
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in TUNABLES or not value.isdigit() or int(value) <= 0:
            raise ValueError(f"--set takes NAME=INT with NAME in {TUNABLES} and INT > 0, got "
                             f"{pair!r}")
        out[name] = int(value)
    return out


def main(argv: list[str] | None = None) -> int:
    from reference.vocabulary import DTYPES

    p = argparse.ArgumentParser(prog="python -m ports.harness.qknorm_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--rep-ms", type=int, default=100, help="timing budget per row (ms)")
    p.add_argument("--shapes", nargs="*", help="shape names to run (default: all)")
    p.add_argument("--check", action="store_true",
                   help="compare every row with the float64 oracle before timing it")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="write the table as a results data file (merged with PATH's other "
                        "shapes if it exists)")
    p.add_argument("--commit", help="the commit measured (default: the checkout's)")
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=INT",
                   help=f"override launch settings of qk_norm_rope: {', '.join(TUNABLES)}")
    args = p.parse_args(argv)
    try:
        settings = _settings(args.set)
    except ValueError as e:
        print(f"qknorm_bench: {e}", file=sys.stderr)
        return 2
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes]
    if not shapes:
        print(f"qknorm_bench: no shape named {args.shapes}; known: "
              f"{[s.name for s in SHAPES]}", file=sys.stderr)
        return 2
    previous = None
    if args.json is not None and args.json.exists():
        try:
            previous = json.loads(args.json.read_text(encoding="utf-8"))
        except ValueError:
            print(f"qknorm_bench: {args.json} exists but is not JSON; name a new file or a data "
                  "file this tool wrote", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("qknorm_bench: needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    from ports.fastrope import qknorm as module

    for name, value in settings.items():
        setattr(module, name, value)
        if name in module.DEVICE_TUNED:  # over the device family's table
            module.FORCED[name] = value
    rows = []
    for shape in shapes:
        rows += measure(shape, DTYPES[args.dtype], args.rep_ms, check=args.check)
    device = torch.device("cuda", torch.cuda.current_device())
    # the per-GPU constants this run used (the family's tuning table, or --set's)
    constants = {name: module.launch_constant(name, device) for name in module.DEVICE_TUNED}
    print(f"GPU: {torch.cuda.get_device_name()}, dtype {args.dtype}, medians (us; CUDA-graph "
          "replays, the backward alone), "
          f"settings {settings or 'default'}, per-GPU constants {constants}\n")
    print(table(rows))
    if args.json is not None:
        command = shlex.join(["python", "-m", "ports.harness.qknorm_bench",
                              *(sys.argv[1:] if argv is None else argv)])
        data = data_file(rows, dtype=args.dtype, command=command, previous=previous,
                         commit=args.commit)
        data["launch_constants"] = constants
        args.json.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
