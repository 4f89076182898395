"""Which launch shape is fastest for fastrope on prefill shapes: register cap, heads per step
(unroll) or head splits? (Needs a GPU.)

Times ``ports/fastrope``'s kernel over register caps (``__launch_bounds__`` minimum blocks, set
through rope.cu's STUDY_MIN_BLOCKS_CAP), heads per step and head splits, optionally from
alternative kernel sources, against torch.compile of the HF function and a copy of the same
bytes, on a few prefill shapes. Every configuration's output is checked bit for bit against
``apply_rope``'s. ``--default-plan`` times only the shipped plan of each source; ``--configs``
only the given (unroll, cap) pairs.

    python -m tools.launch_shape_sweep [--source ports/fastrope/rope.cu variant.cu ...] [--quick]
    python -m tools.launch_shape_sweep --default-plan --source ports/fastrope/rope.cu old.cu
    python -m tools.launch_shape_sweep --configs 1,6 2,1 --shapes bshd:1x4096x32x128:bf16
"""
from __future__ import annotations

import argparse
import itertools
import pathlib

import torch

from ports.eager.canonical import _compiled_apply
from ports.fastrope import apply_rope
from ports.harness.timing import copy_bandwidth_gbps, median_us
from tools._probe_kit import checked_launch, launch_of, make, min_of_interleaved

SHAPES = [  # layout, (b, s, h, d) in bshd order, dtype
    ("bshd", (4, 4096, 32, 128), torch.bfloat16),
    ("bshd", (1, 4096, 32, 128), torch.bfloat16),
    ("sbhd", (4, 4096, 32, 128), torch.bfloat16),
    ("bshd", (4, 4096, 32, 128), torch.float32),
    ("bshd", (1, 32768, 8, 128), torch.bfloat16),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", nargs="+", default=["ports/fastrope/rope.cu"])
    ap.add_argument("--quick", action="store_true", help="fewer configurations")
    ap.add_argument("--default-plan", action="store_true",
                    help="only the shipped plan of each source (min of 3 interleaved medians)")
    ap.add_argument("--configs", nargs="+", metavar="UNROLL,CAP",
                    help="only these (unroll, min blocks) pairs against the shipped plan, tables "
                         "and computed angles (min of 3 interleaved medians)")
    ap.add_argument("--shapes", nargs="+", metavar="LAYOUT:BxSxHxD:DTYPE",
                    help="with --configs: shapes (default: SHAPES)")
    args = ap.parse_args()
    sources = {pathlib.Path(f).stem: pathlib.Path(f).read_text() for f in args.source}
    if args.default_plan:
        return default_plans(sources)
    if args.configs:
        return compare_configs(args.configs, args.shapes)
    copy = copy_bandwidth_gbps()
    print(f"copy bandwidth (1 GiB) {copy:.0f} GB/s")
    compiled = _compiled_apply()
    unrolls = (1, 2, 4)
    caps = (1, 4, 6, 8) if not args.quick else (1, 6)
    for layout, shape, dtype in SHAPES:
        x, cos, sin = make(layout, shape, dtype)
        io = 2 * x.numel() * x.element_size()
        ref = apply_rope(x, cos=cos, sin=sin, layout=layout)
        same = torch.empty_like(x)
        t_copy = median_us(lambda: same.copy_(x))
        rows = cos[None, :, :] if layout == "bshd" else cos[:, None, :]
        srows = sin[None, :, :] if layout == "bshd" else sin[:, None, :]
        t_comp = median_us(lambda: compiled(x, None, rows, srows, 2))
        t_api = median_us(lambda: apply_rope(x, cos=cos, sin=sin, layout=layout))
        print(f"\n## {layout} {shape} {dtype}: io {io / 1e6:.0f} MB; same-size copy {t_copy:.1f} us "
              f"({io / t_copy / 1e3 / copy * 100:.1f}% of copy bw); compile {t_comp:.1f}; "
              f"apply_rope {t_api:.1f}")
        out = torch.empty_like(x)
        results = []
        for (name, src), computed, unroll, cap, one_step in itertools.product(
                sources.items(), (False, True), unrolls, caps, (False, True)):
            if computed and (cap not in (1, 6) or one_step):
                continue
            try:
                splits = None
                if one_step:  # each thread one step of `unroll` heads
                    _, p = launch_of(x, out, cos, sin, layout, computed, unroll, cap, None, src)
                    splits = max(1, -(-shape[2] // (unroll * p.block[1])))
                    if splits == 1:
                        continue
                call, p, ok = checked_launch(x, out, cos, sin, ref, layout, computed, unroll, cap,
                                             splits, src)
            except Exception as exc:  # noqa: BLE001
                print(f"{name} computed={computed} unroll={unroll} cap={cap}: {exc}")
                continue
            t = median_us(call)
            results.append((t, f"{name:10s} {'comp' if computed else 'tab '} unroll={unroll} "
                               f"cap={cap} grid={p.grid} block={p.block} "
                               f"{'ok ' if ok else 'BAD'} {t:7.1f} us {io / t / 1e3 / copy * 100:5.1f}% "
                               f"vs compile {t / t_comp:.3f}"))
        for _, line in sorted(results):
            print(line)


def compare_configs(configs, shapes):
    src = pathlib.Path("ports/fastrope/rope.cu").read_text()
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    todo = SHAPES if not shapes else [
        (lay, tuple(int(n) for n in dims.split("x")), dtypes[dt])
        for lay, dims, dt in (s.split(":") for s in shapes)]
    pairs = [(None, 1)] + [tuple(int(n) for n in c.split(",")) for c in configs]
    comp = _compiled_apply()
    for layout, shape, dtype in todo:
        x, cos, sin = make(layout, shape, dtype)
        out = torch.empty_like(x)
        ref = apply_rope(x, cos=cos, sin=sin, layout=layout)
        rows = cos[None, :, :] if layout == "bshd" else cos[:, None, :]
        srows = sin[None, :, :] if layout == "bshd" else sin[:, None, :]
        calls = {"compile": lambda: comp(x, None, rows, srows, 2)}
        for (unroll, cap), computed in itertools.product(pairs, (False, True)):
            call, p, ok = checked_launch(x, out, cos, sin, ref, layout, computed, unroll, cap,
                                         None, src)
            calls[f"{'comp' if computed else 'tab'} u{p.unroll}c{cap}{'' if ok else ' BAD'}"] = call
        print_times(layout, shape, dtype, min_of_interleaved(calls))


def default_plans(sources):
    """The shipped plan of every source on every shape, tables and computed angles."""
    for layout, shape, dtype in SHAPES:
        x, cos, sin = make(layout, shape, dtype)
        out = torch.empty_like(x)
        ref = apply_rope(x, cos=cos, sin=sin, layout=layout)
        calls = {}
        for (name, src), computed in itertools.product(sources.items(), (False, True)):
            call, _, ok = checked_launch(x, out, cos, sin, ref, layout, computed, None, 1, None,
                                         src)
            calls[f"{name} {'comp' if computed else 'tab'}{'' if ok else ' BAD'}"] = call
        print_times(layout, shape, dtype, min_of_interleaved(calls))


def print_times(layout, shape, dtype, times):
    print(f"{layout} {shape} {str(dtype)[6:]}: "
          + " | ".join(f"{k} {t:.1f}" for k, t in times.items()))


if __name__ == "__main__":
    main()
