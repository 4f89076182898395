"""Times fused ``qk_norm_rope`` against the unfused pairs, forward and backward, on the GPU.

    python -m ports.harness.qknorm_bench [--dtype bf16] [--rep-ms 100] [--shapes NAME..]
                                                [--set BACKWARD_WARPS=8 ...]

Rows, per shape and direction (every time the median of CUDA-graph replays, in us):

* ``fused``: :func:`ports.fastrope.qknorm.qk_norm_rope`;
* ``rms_norm + fastrope``: ``torch.nn.functional.rms_norm`` on q and k, then
  ``fastrope.apply_rope`` (one RMSNorm kernel per tensor, then one RoPE launch for both);
* ``hf eager + fastrope``: transformers' Qwen3RMSNorm formula in eager PyTorch, then
  ``fastrope.apply_rope``;
* ``compiled unfused``: ``torch.compile(fullgraph=True)`` of transformers' norm then its
  rotate-half RoPE (what a user gets today by compiling the model);
* ``copy``: a device-to-device copy moving the same bytes as the fused kernel must:
  forward, read q and k and write them (2 x (q + k) bytes); backward, read dy and the saved x of
  q and k and write dq and dk (3 x (q + k) bytes).

``% copy`` is the copy's time over the row's time (100% = at the copy ceiling); ``x unfused``
is the ``rms_norm + fastrope`` time over the row's. Backward rows time
``torch.autograd.grad`` of the outputs with respect to q, k and (where the row has them as
parameters) the two weights. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

EPS = 1e-6


@dataclass(frozen=True)
class Shape:
    name: str
    b: int
    s: int
    hq: int
    hk: int
    d: int
    gemma: bool = False


SHAPES = [
    Shape("qwen3-8b prefill 4k", 1, 4096, 32, 8, 128),
    Shape("qwen3-8b train 4x4k", 4, 4096, 32, 8, 128),
    Shape("qwen3-0.6b 16k", 1, 16384, 16, 8, 128),
    Shape("gemma3 8k (d 256)", 1, 8192, 8, 4, 256, gemma=True),
    Shape("decode 64 tokens", 64, 1, 32, 8, 128),
]


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


def _unfused_compiled(q, k, qw, kw, cos, sin, gemma):
    qn, kn = _hf_norm(q, qw, EPS, gemma), _hf_norm(k, kw, EPS, gemma)
    return _hf_rope(qn, cos, sin), _hf_rope(kn, cos, sin)


def _rows(shape: Shape, dtype: torch.dtype):
    """(name, forward fn) pairs; each fn takes (q, k, qw, kw, cos, sin) and returns (q, k)."""
    from ports.fastrope import apply_rope
    from ports.fastrope.qknorm import qk_norm_rope

    s = shape.s

    def fused(q, k, qw, kw, cos, sin):
        return qk_norm_rope(q, k, qw, kw, EPS, cos=cos, sin=sin, gemma=shape.gemma)

    def rms_norm_fastrope(q, k, qw, kw, cos, sin):
        d = q.shape[-1]
        wq, wk = (1.0 + qw, 1.0 + kw) if shape.gemma else (qw, kw)
        qn = torch.nn.functional.rms_norm(q, (d,), wq.to(q.dtype), EPS)
        kn = torch.nn.functional.rms_norm(k, (d,), wk.to(k.dtype), EPS)
        return apply_rope(qn, kn, cos=cos, sin=sin, check_positions=False)

    def hf_fastrope(q, k, qw, kw, cos, sin):
        return apply_rope(_hf_norm(q, qw, EPS, shape.gemma), _hf_norm(k, kw, EPS, shape.gemma),
                          cos=cos, sin=sin, check_positions=False)

    compiled = torch.compile(_unfused_compiled, fullgraph=True)

    def compiled_unfused(q, k, qw, kw, cos, sin):
        return compiled(q, k, qw, kw, cos[:s], sin[:s], shape.gemma)

    return [("fused", fused), ("rms_norm + fastrope", rms_norm_fastrope),
            ("hf eager + fastrope", hf_fastrope), ("compiled unfused", compiled_unfused)]


def _inputs(shape: Shape, dtype: torch.dtype, grad: bool):
    from reference.tables import rope_tables

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(shape.b, shape.s, shape.hq, shape.d, device="cuda", generator=g).to(dtype)
    k = torch.randn(shape.b, shape.s, shape.hk, shape.d, device="cuda", generator=g).to(dtype)
    qw = (torch.randn(shape.d, device="cuda", generator=g) * 0.1 + 1).to(dtype)
    kw = (torch.randn(shape.d, device="cuda", generator=g) * 0.1 + 1).to(dtype)
    cos, sin = rope_tables(shape.s, shape.d, device="cuda")
    if grad:
        for t in (q, k, qw, kw):
            t.requires_grad_(True)
    return q, k, qw, kw, cos, sin


def measure(shape: Shape, dtype: torch.dtype, rep_ms: int) -> list[dict]:
    """One row per (direction, implementation), plus the copy rows."""
    from ports.harness.timing import copy_us, graph_median_us

    item = torch.empty((), dtype=dtype).element_size()
    qk_bytes = shape.b * shape.s * (shape.hq + shape.hk) * shape.d * item
    rows = []
    for direction, moved in (("forward", 2 * qk_bytes), ("backward", 3 * qk_bytes)):
        copy = copy_us(moved // 2, graph=True)
        rows.append(dict(shape=shape.name, direction=direction, impl="copy", us=copy,
                         copy_us=copy))
        for name, fn in _rows(shape, dtype):
            try:
                if direction == "forward":
                    args = _inputs(shape, dtype, grad=False)
                    with torch.no_grad():
                        fn(*args)  # compile / warm up outside the capture
                        us = graph_median_us(lambda: fn(*args), rep_ms=rep_ms)
                else:
                    args = _inputs(shape, dtype, grad=True)
                    outs = fn(*args)
                    grads = [torch.randn_like(o) for o in outs]
                    leaves = args[:4]

                    def bwd():
                        return torch.autograd.grad(outs, leaves, grads, retain_graph=True)

                    bwd()
                    us = graph_median_us(bwd, rep_ms=rep_ms)
                rows.append(dict(shape=shape.name, direction=direction, impl=name, us=us,
                                 copy_us=copy))
            except Exception as e:  # a row that cannot run says why, the rest still run
                rows.append(dict(shape=shape.name, direction=direction, impl=name, us=None,
                                 copy_us=copy, reason=f"{type(e).__name__}: {e}"[:80]))
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table (one unit: microseconds)."""
    lines = ["| shape | direction | implementation | us | % copy | x unfused |",
             "|---|---|---|---:|---:|---:|"]
    unfused = {(r["shape"], r["direction"]): r["us"] for r in rows
               if r["impl"] == "rms_norm + fastrope"}
    for r in rows:
        if r["us"] is None:
            lines.append(f"| {r['shape']} | {r['direction']} | {r['impl']} | "
                         f"{r.get('reason', 'error')} | | |")
            continue
        base = unfused.get((r["shape"], r["direction"]))
        ratio = f"{base / r['us']:.2f}" if base else ""
        lines.append(f"| {r['shape']} | {r['direction']} | {r['impl']} | {r['us']:.1f} | "
                     f"{100 * r['copy_us'] / r['us']:.0f}% | {ratio} |")
    return "\n".join(lines)


# Launch settings of ports.fastrope.qknorm that ``--set`` may override (module constants).
TUNABLES = ("MAX_BLOCK_ELEMENTS", "MAX_BLOCK_ELEMENTS_BWD", "LONG_RUN_TOKENS",
            "LONG_RUN_MIN_TOKENS", "FORWARD_WARPS", "BACKWARD_WARPS")


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
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=INT",
                   help=f"override launch settings of qk_norm_rope: {', '.join(TUNABLES)}")
    args = p.parse_args(argv)
    try:
        settings = _settings(args.set)
    except ValueError as e:
        print(f"qknorm_bench: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("qknorm_bench: needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes]
    if not shapes:
        print(f"qknorm_bench: no shape named {args.shapes}; known: "
              f"{[s.name for s in SHAPES]}", file=sys.stderr)
        return 2
    from ports.fastrope import qknorm as module

    for name, value in settings.items():
        setattr(module, name, value)
    rows = []
    for shape in shapes:
        rows += measure(shape, DTYPES[args.dtype], args.rep_ms)
    print(f"GPU: {torch.cuda.get_device_name()}, dtype {args.dtype}, CUDA-graph medians (us), "
          f"settings {settings or 'default'}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
