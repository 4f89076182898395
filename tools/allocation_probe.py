"""Does a CUDA-graph time depend on the memory the tensors occupy? (Needs a GPU.)

The prefill suite's bshd 4x4096x32x128 bf16 case (134 MB moved out of place), the same
implementations on the same inputs, timed by the harness's graph timer (``do_bench_cudagraph``)
and by a graph of 200 calls (the median of 10 replays):

``prepare``: forward, and the backward through autograd (captured on the stream its forward
ran on), with the registry's calls prepared one at a time and the allocator's cache emptied
between them (as the harness's ``run_case`` does) or all at once before any is timed; two
interleaved rounds. fastrope.rope, torch.compile and flash-attn (forward only: its entry has no
backward).

``pool``: the output at gaps of 0-48 MiB after the input, in one allocation: fastrope's design
and its data stores or loads plain instead of streaming, launched directly; flash-attn, its
output allocation redirected into the pool; a copy.

    python -m tools.allocation_probe [prepare] [pool]
"""
from __future__ import annotations

import sys
from unittest import mock

import torch

from ports import registry
from ports.fastrope import apply_rope
from ports.harness.suites import get_suite
from ports.harness.timing import graph_median_us
from ports.peers import flash_attn_rotary
from reference.case import make_inputs
from tools._probe_kit import checked_launch, make, run_named, stream_graph_us, with_hints

NAMES = ("fastrope.rope", "torch.compile(hf_rotate_half)", "flash_attn.apply_rotary")
CALLS, REPLAYS = 200, 10


def _case():
    return next(c for c in get_suite("prefill")
                if c.layout == "bshd" and c.batch == 4 and c.dtype == "bf16")


def prepare():
    case = _case()
    stream = torch.cuda.Stream()
    rows: dict = {}
    for _ in range(2):
        for direction in ("forward", "backward"):
            c = case.replace(direction=direction)
            specs = [registry.get(n) for n in NAMES
                     if direction == "forward" or n != "flash_attn.apply_rotary"]
            for mode in ("one at a time", "all at once"):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    inputs = make_inputs(c, 0, torch.device("cuda"))
                    held = ({s.name: s.prepare(c, inputs) for s in specs}
                            if mode == "all at once" else {})
                    for spec in specs:
                        fn = held.get(spec.name) or spec.prepare(c, inputs)
                        for _ in range(3):
                            fn()
                        t = stream_graph_us(fn, stream, CALLS, REPLAYS)
                        # do_bench_cudagraph captures on a stream of its own, where autograd
                        # cannot run a backward built on this one
                        t_bench = graph_median_us(fn) if direction == "forward" else None
                        rows.setdefault((direction, mode, spec.name), []).append((t, t_bench))
                        del fn
                        if mode == "one at a time":
                            torch.cuda.synchronize()
                            torch.cuda.empty_cache()
                    del held, inputs
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    print(f"\n## {case.describe()}: us per call, {CALLS}-call graph / do_bench_cudagraph, "
          "two rounds")
    print("| direction | calls prepared | implementation | round 1 | round 2 |")
    print("|---|---|---|---|---|")
    for (direction, mode, name), times in rows.items():
        cells = [f"{a:.2f}" + (f" / {b:.2f}" if b is not None else "") for a, b in times]
        print(f"| {direction} | {mode} | {name} | " + " | ".join(cells) + " |")


def pool():
    layout, shape, dtype = "bshd", (4, 4096, 32, 128), torch.bfloat16
    x0, cos, sin = make(layout, shape, dtype)
    half_cos, half_sin = cos[:, :64].contiguous(), sin[:, :64].contiguous()
    n, mib = x0.numel(), (1 << 20) // x0.element_size()
    gaps = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
    buffer = torch.empty(2 * n + max(gaps) * mib, dtype=dtype, device="cuda")
    x = buffer[:n].view(shape)
    x.copy_(x0)
    ref = apply_rope(x, cos=cos, sin=sin, layout=layout)
    source = open("ports/fastrope/rope.cu").read()
    variants = {h: with_hints(source, h) for h in ("cs/cs", "cs/plain", "plain/cs", "plain/plain")}
    flash = flash_attn_rotary()
    empty_like = torch.empty_like
    print(f"\n## bshd {'x'.join(map(str, shape))} bf16 out of place, output after the input in "
          "one allocation: do_bench_cudagraph us")
    print("| gap MiB | fastrope (design: loads / stores cs / cs) | cs / plain | plain / cs | "
          "plain / plain | flash-attn | copy |")
    print("|---|---|---|---|---|---|---|")
    for gap in gaps:
        out = buffer[n + gap * mib:2 * n + gap * mib].view(shape)
        launches = [checked_launch(x, out, cos, sin, ref, layout, False, None, 1, None, text)
                    for text in variants.values()]
        into_pool = lambda t, *a, **k: out if t.shape == x.shape else empty_like(t, *a, **k)
        with mock.patch.object(torch, "empty_like", into_pool):
            def flash_call():
                return flash.apply_rotary(x, half_cos, half_sin, interleaved=False)
            out.fill_(float("nan"))
            flash_call()
            ok_flash = (out.float() - ref.float()).abs().max().item() < 0.1
            calls = [fn for fn, _, _ in launches] + [flash_call, lambda: out.copy_(x)]
            times = [graph_median_us(c) for c in calls]
        assert all(ok for _, _, ok in launches) and ok_flash, gap
        print(f"| {gap} | " + " | ".join(f"{t:.2f}" for t in times) + " |", flush=True)


PROBES = {"prepare": prepare, "pool": pool}

if __name__ == "__main__":
    run_named(PROBES, sys.argv[1:])
