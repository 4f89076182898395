"""End to end in transformers: fastrope patched against unpatched (and Liger's rotary patch where
Liger is installed), per family and size, alternating A/B.

Usage::

    python -m ports.harness.hf_bench --family llama --size 1b --reps 10 \\
        --csv results/hf_bench.csv
    python -m ports.harness.hf_bench --family all --size tiny --modes train,decode

Modes, each timed with CUDA events after a warm-up, per variant:

* ``train``: one bf16 forward and backward of ``[batch, seq]`` tokens (labels = inputs).
* ``prefill``: one bf16 forward of ``[1, prefill]`` tokens, no cache, the last token's logits
  only (``--prefill 16384`` is the long-context case).
* ``decode``: ``generate`` with HF's static cache, its decode step compiled by transformers
  (reduce-overhead: CUDA graphs), ``--new-tokens`` greedy tokens for ``[batch, 16]`` prompts;
  reported as tokens/s, the prefill and the compile excluded by timing two lengths and taking
  the difference.

Repetitions alternate the variants (A B C, B C A, ...), so drift on the machine spreads over all
of them; each repetition is one number (the mean over ``--iters`` calls) and a cell is the median
of ``--reps`` repetitions with their min and max. Peak memory is ``max_memory_allocated`` over
one call. Rows (one per cell) carry the GPU, the versions and the commit; with ``--csv`` they are
appended there, and a table is printed.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import time
from typing import Callable

import torch

from ports.fastrope import hf, hf_models

MODES = ("train", "prefill", "decode")
SETTINGS = ("family", "size", "mode", "variant", "unit", "reps", "iters", "batch", "seq",
            "prefill", "new_tokens", "dtype")
FIELDS = (*SETTINGS, "status", "median", "min", "max", "peak_mib", "gpu", "device", "torch",
          "transformers", "kernels", "liger_kernel", "triton", "cupy", "python", "git_sha",
          "timestamp")
"""The CSV's columns: a row per cell; a cell that could not run has a status and no numbers."""
SIZES = {"tiny": hf_models.TINY, "1b": hf_models.ONE_B}


# ---- variants -----------------------------------------------------------------------------------
def _liger():
    """Liger's HF drop-in (rotate-half, full width only), or None when not installed."""
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    return liger_rotary_pos_emb


def variants(name: str, *, liger: bool, device: torch.device) -> dict[str, Callable | str]:
    """Variant name -> a context manager factory that installs it, or a reason it cannot run."""
    row = hf.family(name)
    found = {"unpatched": contextlib.nullcontext, "fastrope": lambda: hf.patch(name)}
    if liger:
        fn = _liger()
        if fn is None:
            found["liger"] = "not installed (pip install liger-kernel)"
        elif device.type != "cuda":
            found["liger"] = "unsupported: Liger's rotary is a Triton kernel (CUDA tensors only)"
        elif row.style != "rotate_half" or row.slices or row.name in ("phi", "stablelm"):
            found["liger"] = "unsupported: Liger's rotary is rotate-half at full head width"
        else:
            found["liger"] = lambda: hf.Patch(hf.module_of(row), "apply_rotary_pos_emb", fn)
    return found


# ---- timing -------------------------------------------------------------------------------------
def _timed_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Mean ms per call of ``fn`` over ``iters`` calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def _peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


class Workload:
    """One mode's call on one model: ``run()`` and how a time becomes the reported value."""

    def __init__(self, mode: str, model, sizes: hf_models.Sizes, args, device):
        gen = torch.Generator(device=device).manual_seed(0)
        self.mode, self.model, self.device = mode, model, device
        if mode == "train":
            self.ids = torch.randint(3, sizes.vocab, (args.batch, args.seq), device=device,
                                     generator=gen)
            self.unit, self.per = "ms", 1.0
        elif mode == "prefill":
            self.ids = torch.randint(3, sizes.vocab, (1, args.prefill), device=device,
                                     generator=gen)
            self.unit, self.per = "ms", 1.0
        else:
            self.ids = torch.randint(3, sizes.vocab, (args.batch, 16), device=device,
                                     generator=gen)
            self.unit, self.per = "tokens/s", float(args.batch * args.new_tokens)
        self.new_tokens = args.new_tokens

    def _generate(self, n: int):
        with torch.no_grad():
            return self.model.generate(self.ids, attention_mask=torch.ones_like(self.ids),
                                       do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                       cache_implementation="static")

    def run(self) -> None:
        if self.mode == "train":
            self.model.train()
            self.model.zero_grad(set_to_none=True)
            self.model(self.ids, labels=self.ids).loss.backward()
        elif self.mode == "prefill":
            self.model.eval()
            with torch.no_grad():
                self.model(self.ids, use_cache=False, logits_to_keep=1)
        else:
            self.model.eval()
            self._generate(self.new_tokens + 1)

    def measure(self, iters: int) -> float:
        """The reported value of one repetition: ms per call, or decode tokens/s."""
        if self.mode != "decode":
            return _timed_ms(self.run, iters, self.device)
        self.model.eval()
        long = _timed_ms(lambda: self._generate(self.new_tokens + 1), iters, self.device)
        short = _timed_ms(lambda: self._generate(1), iters, self.device)
        return self.per / ((long - short) / 1e3)


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_family(name: str, args, device) -> list[dict]:
    """Every (mode, variant) cell of one family: values alternated over the repetitions."""
    sizes = SIZES[args.size]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = hf_models.model(name, sizes, dtype=dtype, device=device, attention="sdpa")
    found = variants(name, liger=args.liger, device=device)
    runnable = [v for v, f in found.items() if not isinstance(f, str)]
    rows = []
    for mode in args.modes:
        work = Workload(mode, model, sizes, args, device)
        values: dict[str, list[float]] = {v: [] for v in runnable}
        peaks = {}
        for v in runnable:  # warm-up (compiles, autotunes, allocates), then the peak
            with found[v]():
                for _ in range(args.warmup):
                    work.run()
                peaks[v] = _peak_mib(work.run, device)
        for rep in range(args.reps):
            shift = rep % len(runnable)
            for v in runnable[shift:] + runnable[:shift]:
                with found[v]():
                    values[v].append(work.measure(args.iters))
        for v, f in found.items():
            base = dict(family=name, size=args.size, mode=mode, variant=v, unit=work.unit,
                        reps=args.reps, iters=args.iters, batch=args.batch, seq=args.seq,
                        prefill=args.prefill, new_tokens=args.new_tokens, dtype=str(dtype))
            if isinstance(f, str):
                rows.append(base | {"status": f})
                continue
            rows.append(base | _summary(values[v]) | {"peak_mib": peaks[v], "status": "ok"})
        del work
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    """One line per cell: median [min, max] and the ratio to unpatched's median."""
    base = {(r["family"], r["mode"]): r["median"] for r in rows
            if r["variant"] == "unpatched" and r["status"] == "ok"}
    lines = ["| family | mode | variant | median [min, max] | unit | vs unpatched | peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['family']} | {r['mode']} | {r['variant']} | {r['status']} "
                         "| | | |")
            continue
        ref = base.get((r["family"], r["mode"]))
        ratio = f"{r['median'] / ref:.3f}" if ref else ""
        lines.append(f"| {r['family']} | {r['mode']} | {r['variant']} | {r['median']:.4g} "
                     f"[{r['min']:.4g}, {r['max']:.4g}] | {r['unit']} | {ratio} | "
                     f"{r['peak_mib']:.0f} |")
    return "\n".join(lines)


def _metadata(device) -> dict[str, str]:
    from ports.harness.env import metadata

    meta = metadata()
    for module in ("transformers", "kernels", "liger_kernel"):
        try:
            meta[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - a missing peer is a value, not an error
            meta[module] = "not installed"
    meta["device"] = str(device)
    return meta


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ports.harness.hf_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="llama",
                   help="a family of the table, a comma list, or 'all'")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--iters", type=int, default=5, help="calls per repetition")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048, help="train: tokens per sequence")
    p.add_argument("--prefill", type=int, default=16384, help="prefill: tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="decode: tokens per sequence")
    p.add_argument("--liger", action="store_true", help="add Liger's rotary patch as a variant")
    p.add_argument("--csv", help="append the rows to this CSV file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    families = sorted(hf.FAMILIES) if args.family == "all" else args.family.split(",")
    args.modes = args.modes.split(",")
    for what, given, known in (("family", families, hf.FAMILIES), ("mode", args.modes, MODES)):
        bad = [g for g in given if g not in known]
        if bad:
            parser.exit(2, f"hf_bench: unknown {what} {', '.join(bad)}; expected "
                           f"{', '.join(sorted(known))}\n")
    if args.reps < 1 or args.iters < 1:
        parser.exit(2, "hf_bench: --reps and --iters must be at least 1\n")
    device = torch.device(args.device)
    meta = _metadata(device)
    rows = [r | meta for name in families for r in bench_family(name, args, device)]
    print(table(rows))
    print(f"\n{meta['gpu']}; torch {meta['torch']}, transformers {meta['transformers']}, "
          f"kernels {meta['kernels']}, liger {meta['liger_kernel']}; {meta['git_sha']}")
    if args.csv:
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
