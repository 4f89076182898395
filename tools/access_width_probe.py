"""Access width, heads per step and register cap of fastrope's kernel past the L2. (Needs a GPU.)

rope.cu launched directly, with the plan's grid for each configuration, from the half-width
tables the registry gives fastrope, in three modes: out of place, out of place by -theta (the
backward's kernel, on dy) and in place. CUDA-graph us (a graph of 60 calls, the median of 10
replays) under two allocation draws (a pad of 1 or 23 MiB allocated before the inputs), beside
a same-size copy and torch.compile's forward and backward (autograd) on the same inputs. Every
configuration's output is checked bit for bit against ``apply_rope``'s before it is timed.

``prefill``: the prefill suite's cases past the L2 (q only): bshd 4x4096x32x128 fp16, bf16 and
fp32, 8x4096x64x128 bf16, 1x32768x8x128 bf16 and fp32; sbhd 4096x4x32x128 bf16 and
32768x1x8x128 fp32. Configurations (bytes per access, heads per step, register cap; ptxas sm_90
registers and resident blocks of 256 threads): 16-bit 16 B x 4 (112, 2), 8 B x 4 (72, 3), 8 B x
4 capped at 4 blocks (64), 16 B x 2 capped at 3 (80), 8 B x 2 (56, 4: the design); fp32 16 B x 4
(88, 2: the design), 8 B x 4 (61, 4), 16 B x 2 capped at 4 (64), 8 B x 2.

``peers``: the peers suite's 16-bit rotate-half prefill cases past the L2 (q and GQA k, 8 heads,
in one launch): 16 B x 4, the design, the design with its head lanes spread evenly over the
passes (40 heads: 10 lanes in 2 full passes instead of 16 and a pass of 8), 8 B x 4.

``hints``: the 16-bit cases of both, fp32 4x4096 and 1x32768x8, and the peers' fp32 case: the
design against its data loads or stores (or both) plain instead of streaming (evict-first);
16-bit also against 8 head lanes with 2 tokens per block (instead of 16 lanes and 1 token) and
4 heads per step, fp32 against 2 (streaming and plain) and 8 B x 2.

``shapes``: the 16-bit cases of ``hints`` but the peers' 1x32768x32 and 8x4096x64: the design
against a thread per chunk of one half loading its partners (as torch.compile's kernel does; 16
B x 1 head at 6 blocks per SM, 8 B x 1, 16 B x 2), a thread per chunk of both halves with 1
head per step (16 B and 8 B), and 8 B x 4.

``traffic``: the prefill suite's cases past the L2 (fp32 8x4096x64 too): the design against its
minimal kernel (the same launch, loads and stores, no rotation: it copies its input; fewer
registers, so also held to the design's resident blocks by shared memory it does not use), and
fp32 against 4 heads per step (the plan in place before 2 heads). Rows give each kernel's
registers (of the last mode launched).

``flat``: the q-only 16-bit cases of ``shapes``: the design against torch.compile's kernel shape
written in CUDA (``_probe_kit.FLAT_SOURCE``: a flat grid of 16-byte chunks, each thread loading
its partner and its full-width cos/sin chunk in x's dtype), out of place and by -theta, 128 or
256 threads per block, streaming or plain accesses; checked against fastrope within 2% (its
tables are rounded to x's dtype).

    python -m tools.access_width_probe [prefill] [peers] [hints] [shapes] [traffic] [flat]
"""
from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple

import torch
from cupy_backends.cuda.api import driver

from ports import _cupy, registry
from ports._adapters import half_width_tables
from ports.fastrope import apply_rope, kernel, launcher, plan, problem
from ports.harness.suites import get_suite
from reference.case import make_inputs
from tools._probe_kit import FLAT_SOURCE, run_named, stream_graph_us, traffic_only, with_hints

CALLS, REPLAYS, PADS_MIB = 60, 10, (1, 23)
MODES = ("out of place", "by -theta", "in place")


class Config(NamedTuple):
    """One launch configuration; None keeps the plan's choice."""

    vector_cap: int | None = None  # elements per access at most
    unroll: int | None = None      # heads per step
    cap: int | None = None         # __launch_bounds__ minimum blocks (rope.cu's register cap)
    even_lanes: bool = False       # head lanes spread evenly over the passes
    lanes: int | None = None       # head lanes per block (the rest of the 256 threads: tokens)
    hints: str = "cs/cs"           # data loads / stores past the L2: streaming (cs) or plain
    one_half: bool = False         # a thread per chunk of one half, loading its partners
    traffic: bool = False          # the minimal kernel: no rotation (_probe_kit.traffic_only)
    resident: int | None = None    # at most this many blocks per SM (idle shared memory)
    flat: int = 0                  # threads per block of the flat kernel instead (0: rope.cu)


DESIGN = Config()
SIXTEEN_BIT = {"16 B x 4": Config(8, 4), "8 B x 4": Config(4, 4),
               "8 B x 4, cap 4": Config(4, 4, 4), "16 B x 2, cap 3": Config(8, 2, 3),
               "8 B x 2 (design)": DESIGN}
FP32 = {"16 B x 4 (design)": DESIGN, "8 B x 4": Config(2, 4),
        "16 B x 2, cap 4": Config(4, 2, 4), "8 B x 2": Config(2, 2)}
PEERS = {"16 B x 4": Config(8, 4), "8 B x 2 (design)": DESIGN,
         "8 B x 2, even lanes": Config(even_lanes=True), "8 B x 4": Config(4, 4)}
HINTS = {"design (cs/cs)": DESIGN, "loads cs, stores plain": Config(hints="cs/plain"),
         "loads plain, stores cs": Config(hints="plain/cs"),
         "plain": Config(hints="plain/plain"), "8 lanes x 2 tokens": Config(lanes=8),
         "4 heads per step": Config(unroll=4)}
# fp32's design takes 4 heads per step and 8 lanes (4 x 4-byte accesses per half) already
HINTS_FP32 = {**{k: c for k, c in HINTS.items() if c.unroll is None and c.lanes is None},
              "2 heads per step": Config(unroll=2),
              "2 heads per step, plain": Config(unroll=2, hints="plain/plain"),
              "8 B x 2": Config(2, 2)}
SHAPES = {"design": DESIGN, "a thread per half, 16 B x 1": Config(unroll=1, one_half=True),
          "a thread per half, 8 B x 1": Config(4, 1, one_half=True),
          "a thread per half, 16 B x 2": Config(unroll=2, one_half=True),
          "both halves, 16 B x 1": Config(unroll=1), "both halves, 8 B x 1": Config(4, 1),
          "8 B x 4": Config(4, 4)}
TRAFFIC = {"design": DESIGN, "traffic alone": Config(traffic=True),
           "traffic alone, 4 blocks per SM (the design's)": Config(traffic=True, resident=4)}
TRAFFIC_FP32 = {"design": DESIGN, "traffic alone": Config(traffic=True),
                "traffic alone, 2 blocks per SM (the design's out of place)":
                Config(traffic=True, resident=2), "4 heads per step": Config(unroll=4)}
SHARED_PER_SM = 228 * 1024  # sm_90
FLAT = {"design": DESIGN, "flat, 128 threads": Config(flat=128, hints="plain/plain"),
        "flat, 256 threads": Config(flat=256, hints="plain/plain"),
        "flat, 128 threads, streaming": Config(flat=128)}

SOURCE = "ports/fastrope/rope.cu"


def launch(xs, outs, cos, sin, layout, config, backward, in_place):
    """The zero-argument launch of one configuration on q (and k) ``xs`` into ``outs``."""
    x = xs[0]
    b, s = (x.shape[1], x.shape[0]) if layout == "sbhd" else (x.shape[0], x.shape[1])
    d = x.shape[-1]
    ops = [plan.Operand(a, o, a.shape[2], problem.strides(a, layout), problem.strides(o, layout))
           for a, o in zip(xs, outs)]
    p = plan.choose(operands=ops, batch=b, seqlen=s, head_dim=d, rotary_dim=d,
                    interleaved=False, tables=(cos, sin, True), computed=False,
                    in_place=in_place, unroll=config.unroll, vector_cap=config.vector_cap,
                    one_half_per_thread=config.one_half)
    if config.even_lanes:
        units = -(-sum(op.heads for op in ops) // p.unroll)
        passes = -(-units // p.block[1])
        p = dataclasses.replace(p, block=(p.block[0], -(-units // passes), p.block[2]))
    if config.lanes:
        tokens = min(plan.MAX_TOKENS_PER_BLOCK,
                     plan.THREADS_PER_BLOCK // (p.block[0] * config.lanes))
        rows = b * s if p.fold else s
        p = dataclasses.replace(p, grid=(-(-rows // tokens), *p.grid[1:]),
                                block=(p.block[0], config.lanes, tokens))
    if config.resident:  # shared memory the kernel does not use: only `resident` blocks fit
        p = dataclasses.replace(p, shared_mem=SHARED_PER_SM // config.resident - 1024 - 128)
    lc = launcher.prepare(p, ops, seqlen=s, half=d // 2, half_table=True,
                          table_rows=cos.shape[0], table_stride=cos.stride(0), pos_mode=0,
                          pos_strides=(0, 0), pos_int32=False, nseq=0, backward=backward)
    options = (f"-DSTUDY_MIN_BLOCKS_CAP={config.cap}",) if config.cap else ()
    source = with_hints(open(SOURCE).read(), config.hints)
    source = traffic_only(source) if config.traffic else source
    fn = _cupy._load(x.get_device(), source, kernel.FILENAME, options, (p.kernel,))[p.kernel]
    if p.shared_mem > 48 * 1024:
        driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                p.shared_mem)
        driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                100)
    lc = dataclasses.replace(lc, function=fn.ptr)
    k_in, k_out = (xs[1].data_ptr(), outs[1].data_ptr()) if len(xs) > 1 else (0, 0)
    args = (x.data_ptr(), k_in, outs[0].data_ptr(), k_out, cos.data_ptr(), sin.data_ptr(),
            0, 0, 0, 0)
    call = lambda: launcher.launch(lc, *args)  # noqa: E731
    call.registers = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, fn.ptr)
    return call


def launch_flat(x, out, cos, sin, layout, config, backward):
    """The zero-argument launch of the flat kernel (_probe_kit.FLAT_SOURCE) on q ``x`` (16-bit)
    into ``out``, from
    full-width tables in x's dtype made from the half-width ``cos``/``sin``."""
    import cupy as cp

    b, s = (x.shape[1], x.shape[0]) if layout == "sbhd" else (x.shape[0], x.shape[1])
    h, d = x.shape[2], x.shape[3]
    cos_full = torch.cat([cos, cos], -1).to(x.dtype).contiguous()
    sin_full = torch.cat([sin, sin], -1).to(x.dtype).contiguous()
    t = "__half" if x.dtype == torch.float16 else "__nv_bfloat16"
    stream = "true" if config.hints == "cs/cs" else "false"
    name = f"flat_rope<{t}, {'true' if backward else 'false'}, {stream}, 1>"
    fn = cp.RawModule(code=FLAT_SOURCE, options=("-std=c++17",),
                      name_expressions=[name]).get_function(name)
    n = x.numel() // 8
    grid = -(-n // config.flat)

    def call():
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            fn((grid,), (config.flat,), (x.data_ptr(), out.data_ptr(), cos_full.data_ptr(),
                                         sin_full.data_ptr(), cp.int64(n), cp.int32(s),
                                         cp.int32(b), cp.int32(h), cp.int32(d),
                                         cp.int32(layout == "sbhd")))

    call.registers = fn.num_regs  # a cupy RawKernel
    return call


def run_cases(cases, configs_of):
    stream = torch.cuda.Stream()
    compiled = registry.get("torch.compile(hf_rotate_half)")
    for case in cases:
        back = case.replace(direction="backward")
        configs = configs_of(case)
        times: dict = {}
        registers: dict = {}
        for pad_mib in PADS_MIB:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                pad = torch.empty(pad_mib << 20, dtype=torch.uint8, device="cuda")
                inputs = make_inputs(back, 0, "cuda")
                n = 2 if case.kv_heads else 1
                xs, dys = list(inputs.xs[:n]), list(inputs.grads[:n])
                cos, sin = half_width_tables(back, inputs)
                outs = [torch.empty_like(t) for t in xs]
                rotated = [t.clone() for t in xs]
                ref = apply_rope(*xs, cos=cos, sin=sin, layout=case.layout)
                ref = ref if isinstance(ref, tuple) else (ref,)
                if any(c.flat for c in configs.values()):  # dy by -theta, through autograd
                    leaves = [t.detach().requires_grad_(True) for t in xs]
                    ys = apply_rope(*leaves, cos=cos, sin=sin, layout=case.layout)
                    ref_back = torch.autograd.grad(ys, leaves, dys)
                calls = {"copy": lambda: [o.copy_(t) for o, t in zip(outs, dys)]}
                for name, config in configs.items():
                    for mode in MODES:
                        src, dst = ((rotated, rotated) if mode == "in place"
                                    else (xs if mode == "out of place" else dys, outs))
                        if config.flat:
                            if mode == "in place" or len(xs) > 1:
                                continue
                            fn = launch_flat(src[0], dst[0], cos, sin, case.layout, config,
                                             mode == "by -theta")
                            outs[0].fill_(float("nan"))
                            fn()
                            want = ref[0] if mode == "out of place" else ref_back[0]
                            assert torch.allclose(outs[0].float(), want.float(), rtol=2e-2,
                                                  atol=2e-2), (name, mode)
                            calls[(name, mode)] = fn
                            registers[name] = fn.registers
                            continue
                        fn = launch(src, dst, cos, sin, case.layout, config,
                                    mode == "by -theta", mode == "in place")
                        if mode == "out of place":
                            for o in outs:
                                o.fill_(float("nan"))
                            fn()
                            want = xs if config.traffic else ref  # the minimal kernel copies
                            assert all(torch.equal(o, r) for o, r in zip(outs, want)), name
                        calls[(name, mode)] = fn
                        registers[name] = fn.registers
                calls[("torch.compile", "out of place")] = compiled.prepare(case, inputs)
                calls[("torch.compile", "by -theta")] = compiled.prepare(back, inputs)
                for key, fn in calls.items():
                    fn()
                    fn()
                    times.setdefault(key, []).append(stream_graph_us(fn, stream, CALLS, REPLAYS))
                del calls, inputs, xs, dys, outs, rotated, pad
            torch.cuda.synchronize()
        draws = " / ".join(f"{p} MiB" for p in PADS_MIB)
        print(f"\n### {case.describe()}: CUDA-graph us, allocation draws {draws}")
        print(f"copy: {' / '.join(f'{t:.2f}' for t in times['copy'])}")
        print("| configuration | out of place | by -theta (backward) | in place |")
        print("|---|---|---|---|")
        for name in (*configs, "torch.compile"):
            cells = [" / ".join(f"{t:.2f}" for t in times[(name, m)]) if (name, m) in times
                     else "-" for m in MODES]
            regs = f" ({registers[name]} registers)" if name in registers else ""
            print(f"| {name}{regs} | " + " | ".join(cells) + " |", flush=True)


def prefill():
    want = {("bshd", 4, 4096, "fp16"), ("bshd", 4, 4096, "bf16"), ("bshd", 4, 4096, "fp32"),
            ("bshd", 8, 4096, "bf16"), ("bshd", 1, 32768, "bf16"), ("bshd", 1, 32768, "fp32"),
            ("sbhd", 4, 4096, "bf16"), ("sbhd", 1, 32768, "fp32")}
    cases = [c for c in get_suite("prefill")
             if (c.layout, c.batch, c.seqlen, c.dtype) in want]
    run_cases(cases, lambda c: FP32 if c.dtype == "fp32" else SIXTEEN_BIT)


def peers():
    cases = [c for c in get_suite("peers") if c.seqlen > 1 and c.dtype != "fp32"
             and c.style == "rotate_half" and c.batch * c.seqlen * c.heads >= 4 * 4096 * 32]
    run_cases(cases, lambda c: PEERS)


def hints():
    want = {("bshd", 4, 4096, "fp16"), ("bshd", 4, 4096, "bf16"), ("bshd", 4, 4096, "fp32"),
            ("bshd", 8, 4096, "bf16"), ("bshd", 1, 32768, "bf16"), ("bshd", 1, 32768, "fp32"),
            ("sbhd", 4, 4096, "bf16")}
    cases = [c for c in get_suite("prefill") if (c.layout, c.batch, c.seqlen, c.dtype) in want]
    cases += [c for c in get_suite("peers") if c.seqlen > 1 and c.style == "rotate_half"
              and c.batch * c.seqlen * c.heads >= 4 * 4096 * 32]
    run_cases(cases, lambda c: HINTS_FP32 if c.dtype == "fp32" else HINTS)


def shapes():
    want = {("bshd", 4, 4096, "fp16"), ("bshd", 4, 4096, "bf16"), ("bshd", 8, 4096, "bf16"),
            ("bshd", 1, 32768, "bf16"), ("sbhd", 4, 4096, "bf16")}
    cases = [c for c in get_suite("prefill") if (c.layout, c.batch, c.seqlen, c.dtype) in want]
    cases += [c for c in get_suite("peers") if c.seqlen > 1 and c.style == "rotate_half"
              and c.dtype != "fp32" and c.batch * c.seqlen * c.heads == 4 * 4096 * 32]
    run_cases(cases, lambda c: SHAPES)


def traffic():
    want = {("bshd", 4, 4096, "fp16"), ("bshd", 4, 4096, "bf16"), ("bshd", 4, 4096, "fp32"),
            ("bshd", 8, 4096, "bf16"), ("bshd", 8, 4096, "fp32"), ("bshd", 1, 32768, "bf16"),
            ("bshd", 1, 32768, "fp32"), ("sbhd", 4, 4096, "bf16"), ("sbhd", 8, 4096, "fp32")}
    cases = [c for c in get_suite("prefill") if (c.layout, c.batch, c.seqlen, c.dtype) in want]
    run_cases(cases, lambda c: TRAFFIC_FP32 if c.dtype == "fp32" else TRAFFIC)


def flat():
    want = {("bshd", 4, 4096, "fp16"), ("bshd", 4, 4096, "bf16"), ("bshd", 8, 4096, "bf16"),
            ("bshd", 1, 32768, "bf16"), ("sbhd", 4, 4096, "bf16")}
    cases = [c for c in get_suite("prefill") if (c.layout, c.batch, c.seqlen, c.dtype) in want]
    run_cases(cases, lambda c: FLAT)


PROBES = {"prefill": prefill, "peers": peers, "hints": hints, "shapes": shapes,
          "traffic": traffic, "flat": flat}

if __name__ == "__main__":
    run_named(PROBES, sys.argv[1:])
