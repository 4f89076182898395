"""fastrope's rows against their minimal kernels, where a peer leads them. (Needs a GPU.)

The minimal kernel is rope.cu built with the rotation replaced by a copy
(``experiment.Variant(traffic_only=True)``): the same plans (the step kernel or the main kernel),
launches, loads (every table element) and stores, so it copies its input. A row that takes as
long as its minimal kernel costs the memory traffic of its launch and nothing more.

Cases: the peers suite's, where a peer led fastrope's row in its own mode (1x4096x32x128 with
k, and the bf16 decode steps), and its prefills past the L2 (4x4096, 8x4096x64, 1x32768, with
k). Rows, from the registry on the suite's inputs: fastrope.rope and fastrope.rope_inplace (the
design, then built as the minimal kernel), Liger (in place, handed its rows) and flash-attn;
CUDA-graph us, the minimum of 3 interleaved medians. The minimal rows' outputs are checked to
equal the inputs. Two copies are timed beside them: the same-size copy the suites' % of copy
divides by (q and k read and written, ``RopeCase.io_bytes``), and one that also moves the bytes
of the cos/sin tables the rows read (prefills, where every table row is read; a decode step
reads only its tokens' rows).

    python -m tools.minimal_kernel_probe
"""
from __future__ import annotations

import torch

from ports import registry
from ports.fastrope import experiment
from ports.harness.suites import get_suite
from ports.harness.timing import copy_us, graph_median_us, min_of_interleaved
from reference.case import make_inputs
from tools._probe_kit import registry_arguments

FASTROPE = ("fastrope.rope", "fastrope.rope_inplace")
PEERS = ("liger.rope", "flash_attn.apply_rotary", "flash_attn.apply_rotary_inplace")
MINIMAL = experiment.Variant(traffic_only=True)


def _rows(case, inputs, names):
    calls = {}
    for name in names:
        spec = registry.get(name)
        missing = getattr(spec, "missing", None)  # peers: None when installed
        if spec.unsupported_reason(case) is None and not (missing and missing()):
            calls[name] = spec.prepare(case, inputs)
    return calls


def _minimal_rows(case, inputs):
    """fastrope's rows built as the minimal kernel (same plans), each checked to copy its
    input."""
    kw = registry_arguments(case, inputs)
    buffers = [x.clone() for x in inputs.xs]
    calls = {
        "fastrope.rope": lambda: experiment.apply_rope(*inputs.xs, variant=MINIMAL, **kw),
        "fastrope.rope_inplace": lambda: experiment.apply_rope(*buffers, variant=MINIMAL,
                                                               in_place=True, **kw),
    }
    for name, fn in calls.items():
        outs = fn()
        outs = outs if isinstance(outs, tuple) else (outs,)
        assert all(torch.equal(o, x) for o, x in zip(outs, inputs.xs)), f"{name}: not a copy"
    return min_of_interleaved(calls, timer=graph_median_us)


def _copies(case, inputs) -> list[float | None]:
    """CUDA-graph us of the same-size copy, and of one that also moves the tables' bytes
    (prefills from position 0 only: a decode step reads only its tokens' rows)."""
    same = copy_us(case.io_bytes() // 2, graph=True)
    if case.positions != "arange":
        return [same, None]
    kw = registry_arguments(case, inputs)
    tables = sum(t.numel() * t.element_size() for t in (kw["cos"], kw["sin"]))
    return [same, copy_us((case.io_bytes() + tables) // 2, graph=True)]


def main():
    want = {(1, 4096), (4, 4096), (8, 4096), (1, 32768), (1, 1), (64, 1), (256, 1)}
    cases = [c for c in get_suite("peers") if (c.batch, c.seqlen) in want
             and c.style == "rotate_half" and c.dtype == "bf16"]
    minimal_names = [f"{n} (minimal)" for n in FASTROPE]
    copies = ("same-size copy", "copy with the tables")
    print("| case | " + " | ".join((*FASTROPE, *minimal_names, *PEERS, *copies)) + " |")
    print("|---|" + "---|" * (2 * len(FASTROPE) + len(PEERS) + len(copies)))
    for case in cases:
        inputs = make_inputs(case, 0, torch.device("cuda"))
        times = min_of_interleaved(_rows(case, inputs, FASTROPE + PEERS), timer=graph_median_us)
        minimal = _minimal_rows(case, inputs)
        cells = [times.get(n) for n in FASTROPE] + [minimal.get(n) for n in FASTROPE] \
            + [times.get(n) for n in PEERS] + _copies(case, inputs)
        print(f"| {case.describe()} | " + " | ".join("-" if t is None else f"{t:.2f}"
                                                   for t in cells) + " |", flush=True)
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
