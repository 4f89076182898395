"""End to end in transformers: fastrope patched against unpatched (and Liger's rotary patch where
Liger is installed), per family and size, alternating A/B.

Usage::

    python -m ports.harness.hf_bench --family llama --size 1b --reps 10 \\
        --csv results/hf_bench.csv
    python -m ports.harness.hf_bench --family all --size tiny --modes train,decode
    python -m ports.harness.hf_bench --family llama,qwen3 --size 1b --modes train \\
        --liger --json results/data/hf-bench.json    # a data file for tools/results_tables.py

Variants: ``unpatched``; ``fastrope`` (:func:`hf.patch`, the rotary alone); ``liger`` (with
``--liger``: Liger's rotary function in the family's module); ``fastrope+qknorm`` for the
families whose q_norm/k_norm + rotary pair fastrope fuses (``hf.patch(..., fuse_qk_norm=True)``:
Qwen3, Qwen3-MoE, Gemma3; OLMo2's row states why not).

Modes, each timed with CUDA events after a warm-up, per variant:

* ``train``: one bf16 forward and backward of ``[batch, seq]`` tokens (labels = inputs).
* ``prefill``: one bf16 forward of ``[1, prefill]`` tokens, no cache, the last token's logits
  only (``--prefill 16384`` is the long-context case).
* ``decode``: ``--new-tokens`` greedy decode steps of ``[batch, 16]`` prompts on HF's static
  cache, captured per variant in one CUDA graph (each step's argmax is the next step's token, as
  ``generate`` feeds them); one replay is one repetition's call, reported as tokens/s (``batch *
  new_tokens`` per replay). The prompt's prefill runs once, before the capture. On a CPU the
  same loop runs eagerly. (``generate``'s own loop spends most of a 1B model's decode step on
  the host: its tokens/s measured the host's drift, not the step.)

Repetitions alternate the variants (A B C, B C A, ...), so drift on the machine spreads over all
of them; each repetition is one number (the mean over ``--iters`` calls) and a cell is the median
of ``--reps`` repetitions with their min and max. Peak memory is ``max_memory_allocated`` over
one call. Rows (one per cell) carry the GPU, the versions and the commit; with ``--csv`` they are
appended there, and a table is printed. With ``--json`` the cells go to a data file that
``tools/results_tables.py`` renders (``columns`` and ``rows`` as quoted, the raw ``cells``, and
the run's provenance); a second run with the same path adds its cells and its command, so one
table can come from several invocations (say the 1B training step of two families and the
decode of one). Each (family, mode) prints its wall time, to plan a run within a time budget.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shlex
import statistics
import sys
import time
from typing import Callable

import torch

from ports.fastrope import hf, hf_models, hf_qknorm

MODES = ("train", "prefill", "decode")
SETTINGS = ("family", "size", "mode", "variant", "unit", "reps", "iters", "batch", "seq",
            "prefill", "new_tokens", "dtype")
FIELDS = (*SETTINGS, "status", "median", "min", "max", "peak_mib", "wall_s", "gpu", "device",
          "torch",
          "transformers", "kernels", "liger_kernel", "triton", "cupy", "python", "git_sha",
          "timestamp")
"""The CSV's columns: a row per cell; a cell that could not run has a status and no numbers."""
SIZES = {"tiny": hf_models.TINY, "1b": hf_models.ONE_B}
FUSED_VARIANT = "fastrope+qknorm"
TABLE_COLUMNS = ("family", "size", "mode", "variant", "median [min, max]", "unit",
                 "vs unpatched", "peak MiB")


# ---- variants -----------------------------------------------------------------------------------
def _liger():
    """Liger's HF drop-in (rotate-half, full width only), or None when not installed."""
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    return liger_rotary_pos_emb


def _reusable(make: Callable[[], hf.Patch]) -> Callable[[], hf.Patch] | str:
    """A factory installing what ``make()`` installs, the same function objects every time: a
    variant's repetitions run what its warm-up compiled and its decode graph captured. A refusal
    becomes the variant's reason."""
    try:
        patch = make()
    except (NotImplementedError, ImportError) as exc:
        return f"unsupported: {exc}"
    installed = [(p.module, p.name, getattr(p.module, p.name))
                 for p in getattr(patch, "parts", (patch,))]
    patch.undo()
    return lambda: hf.Patches(*(hf.Patch(m, n, r) for m, n, r in installed))


def variants(name: str, *, liger: bool, device: torch.device) -> dict[str, Callable | str]:
    """Variant name -> a context manager factory that installs it, or a reason it cannot run."""
    row = hf.family(name)
    found = {"unpatched": contextlib.nullcontext, "fastrope": _reusable(lambda: hf.patch(name))}
    if name in hf_qknorm.FUSED:
        found[FUSED_VARIANT] = _reusable(lambda: hf.patch(name, fuse_qk_norm=True))
    elif name in hf_qknorm.REFUSED:
        found[FUSED_VARIANT] = f"unsupported: {hf_qknorm.REFUSED[name]}"
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
            ids = torch.randint(3, sizes.vocab, (args.batch, 16), device=device, generator=gen)
            self.decode = DecodeLoop(model, ids, args.new_tokens)
            self.unit, self.per = "tokens/s", float(args.batch * args.new_tokens)

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
            self.decode.run()

    def measure(self, iters: int, variant: str) -> float:
        """The reported value of one repetition of ``variant`` (installed by the caller): ms per
        call, or decode tokens/s."""
        if self.mode != "decode":
            return _timed_ms(self.run, iters, self.device)
        return self.per / (_timed_ms(self.decode.replayer(variant), iters, self.device) / 1e3)


class DecodeLoop:
    """Greedy decode on HF's static cache: the prompt's prefill once, then ``steps`` single-token
    forwards, each fed the previous step's argmax. The cache counts its own length (a device
    tensor per layer, from which the model takes its positions): each loop first rewinds it to
    the prompt, so every run, eager or a CUDA graph's replay, redoes the same steps in the same
    cache slots. On a GPU a variant's loop is captured in one CUDA graph (the variant installed
    while it is captured) and timed by replaying it."""

    def __init__(self, model, ids: torch.Tensor, steps: int):
        from transformers import StaticCache

        self.model, self.device = model, ids.device
        self.prompt, self.steps = ids.shape[1], steps
        self.cache = StaticCache(config=model.config, max_cache_len=self.prompt + steps)
        model.eval()
        with torch.no_grad():
            logits = model(ids, past_key_values=self.cache, use_cache=True,
                           logits_to_keep=1).logits
        self.first = logits[:, -1:].argmax(-1)  # [batch, 1]
        short = [layer.max_cache_len for layer in self.cache.layers
                 if getattr(layer, "is_sliding", False)
                 and layer.max_cache_len < self.prompt + steps]
        if short:  # a full window rolls its slots: a loop could not be redone from the prompt
            raise ValueError(f"decode: a sliding window of {min(short)} tokens is shorter than "
                             f"the prompt and the steps ({self.prompt} + {steps}); "
                             f"the loop could not be rewound")
        self.graphs: dict[str, Callable[[], None]] = {}

    def _rewind(self) -> None:
        """Every layer's length back to the prompt's: in place for a device counter (a kernel a
        graph replays), assigned for a host one (read while a graph is captured)."""
        for layer in self.cache.layers:
            for name in ("cumulative_length", "cumulative_length_int"):
                length = getattr(layer, name, None)
                if isinstance(length, torch.Tensor):
                    length.fill_(self.prompt)
                elif length is not None:
                    setattr(layer, name, self.prompt)

    def run(self) -> torch.Tensor:
        """The loop, eagerly, with whatever is installed; the last step's tokens."""
        self.model.eval()
        token = self.first
        with torch.no_grad():
            self._rewind()
            for _ in range(self.steps):
                logits = self.model(token, past_key_values=self.cache, use_cache=True,
                                    logits_to_keep=1).logits
                token = logits[:, -1:].argmax(-1)
        return token

    def replayer(self, variant: str) -> Callable[[], None]:
        """A call that runs ``variant``'s loop: its CUDA graph's replay (captured at the first
        call, with the variant installed), or the eager loop on a CPU."""
        if self.device.type != "cuda":
            return self.run
        if variant not in self.graphs:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # compiles, autotunes, allocates before the capture
                self.run()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.run()
            self.graphs[variant] = graph.replay
        return self.graphs[variant]


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _failure(exc: BaseException) -> str:
    """A cell's status for a mode that raised: "OOM", or "error: Type: first line"."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "OOM"
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"error: {type(exc).__name__}: {first}"


def _measure_mode(work: Workload, found: dict, runnable: list[str], args, device
                  ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """(values per variant over the alternating repetitions, peak MiB per variant)."""
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
                values[v].append(work.measure(args.iters, v))
    return values, peaks


def bench_family(name: str, args, device) -> list[dict]:
    """Every (mode, variant) cell of one family: values alternated over the repetitions. A mode
    that raises (OOM, a compile failure) gives its cells that status, and the run goes on."""
    sizes = SIZES[args.size]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = hf_models.model(name, sizes, dtype=dtype, device=device, attention="sdpa")
    found = variants(name, liger=args.liger, device=device)
    runnable = [v for v, f in found.items() if not isinstance(f, str)]
    rows = []
    for mode in args.modes:
        started = time.perf_counter()
        work = Workload(mode, model, sizes, args, device)
        try:
            values, peaks = _measure_mode(work, found, runnable, args, device)
            failed = None
        except Exception as exc:  # noqa: BLE001 - the cell states it; other modes still run
            failed = _failure(exc)
        wall = time.perf_counter() - started
        print(f"hf_bench: {name} {args.size} {mode}: {wall:.1f} s for {len(runnable)} variants"
              + (f" ({failed})" if failed else ""), file=sys.stderr, flush=True)
        for v, f in found.items():
            base = dict(family=name, size=args.size, mode=mode, variant=v, unit=work.unit,
                        reps=args.reps, iters=args.iters, batch=args.batch, seq=args.seq,
                        prefill=args.prefill, new_tokens=args.new_tokens, dtype=str(dtype),
                        wall_s=round(wall, 1))
            if isinstance(f, str) or failed:
                rows.append(base | {"status": f if isinstance(f, str) else failed})
                continue
            rows.append(base | _summary(values[v]) | {"peak_mib": peaks[v], "status": "ok"})
        model.zero_grad(set_to_none=True)  # the next mode's peak holds no gradients
        del work
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table_rows(rows: list[dict]) -> list[list[str]]:
    """The cells as strings, one list per cell in :data:`TABLE_COLUMNS`' order: median [min,
    max], the ratio of the medians to unpatched's, the peak; or the reason it did not run."""
    base = {(r["family"], r["size"], r["mode"]): r["median"] for r in rows
            if r["variant"] == "unpatched" and r["status"] == "ok"}
    out = []
    for r in rows:
        head = [r["family"], r["size"], r["mode"], r["variant"]]
        if r["status"] != "ok":
            out.append(head + [r["status"], "", "", ""])
            continue
        ref = base.get((r["family"], r["size"], r["mode"]))
        ratio = f"{r['median'] / ref:.3f}" if ref else ""
        peak = r.get("peak_mib")
        peak = "-" if peak is None or peak != peak else f"{peak:.0f}"  # NaN or null: no GPU
        out.append(head + [f"{r['median']:.4g} [{r['min']:.4g}, {r['max']:.4g}]", r["unit"],
                           ratio, peak])
    return out


def table(rows: list[dict]) -> str:
    """The cells as a markdown table (:func:`table_rows`)."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
    return "\n".join(lines)


def earlier_run(path: str, meta: dict[str, str]) -> dict | None:
    """The data file at ``path`` (None if there is none), refused with exit 2 when it holds
    another GPU's or commit's run: one table never mixes machines or trees."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        found = old["gpu"], old["commit"], old["cells"], old["command"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"hf_bench: {path} is not an hf_bench data file ({type(exc).__name__}: {exc}); "
              f"write another path", file=sys.stderr)
        raise SystemExit(2) from None
    if found[:2] != (meta["gpu"], meta["git_sha"]):
        print(f"hf_bench: {path} holds a run on {found[0]} at {found[1]}, this is "
              f"{meta['gpu']} at {meta['git_sha']}; write another path", file=sys.stderr)
        raise SystemExit(2)
    return old


def write_data_file(path: str, rows: list[dict], meta: dict[str, str], command: str) -> None:
    """The cells as a results data file (``tools/results_tables.py``: ``columns``, ``rows`` and
    the provenance it checks), merged into ``path`` when that exists: its cells and commands
    kept, a cell measured again replaced. The provenance is the last run's; a run on another GPU
    or commit than the file's is refused, so one table never mixes machines."""
    from ports.harness.env import driver_version

    key = ("family", "size", "mode", "variant")
    old = earlier_run(path, meta) or {"cells": [], "command": []}
    new = {tuple(r[k] for k in key) for r in rows}
    cells = [c for c in old["cells"] if tuple(c[k] for k in key) not in new]
    cells += [{k: (None if r[k] != r[k] else r[k]) for k in FIELDS if k in r}  # NaN: null
              for r in rows]
    families = list(dict.fromkeys(c["family"] for c in cells))  # first run's order first
    cells.sort(key=lambda c: (families.index(c["family"]), c["size"], MODES.index(c["mode"])))
    data = {
        "document": "results/README.md",
        "section": "not recorded",
        "context": ("python -m ports.harness.hf_bench: bf16 models with random weights, sdpa "
                    "attention; median [min, max] over the alternating repetitions; vs "
                    "unpatched: the ratio of the medians (decode: tokens/s, higher is better)"),
        "command": [*old["command"], command],
        "commit": meta["git_sha"],
        "gpu": meta["gpu"],
        "driver": driver_version(),
        "versions": {m: meta[m] for m in ("torch", "triton", "transformers", "kernels",
                                          "liger_kernel")},
        "date": meta["timestamp"][:10],
        "columns": list(TABLE_COLUMNS),
        "rows": table_rows(cells),
        "cells": cells,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def _metadata(device) -> dict[str, str]:
    from ports.harness.env import metadata

    meta = metadata()
    from importlib.metadata import PackageNotFoundError, version

    for module, dist in (("transformers", "transformers"), ("kernels", "kernels"),
                         ("liger_kernel", "liger-kernel")):  # liger_kernel has no __version__
        try:
            meta[module] = version(dist)
        except PackageNotFoundError:  # a missing peer is a value, not an error
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
    p.add_argument("--json", help="write (or add to) this results data file "
                                  "(results/data/NAME.json, for tools/results_tables.py)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--commit", help="the commit measured (default: the checkout's)")
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
    if args.commit:
        meta["git_sha"] = args.commit
    if args.json:
        earlier_run(args.json, meta)  # refused before anything is measured
    rows = [r | meta for name in families for r in bench_family(name, args, device)]
    print(table(rows))
    print(f"\n{meta['gpu']}; torch {meta['torch']}, transformers {meta['transformers']}, "
          f"kernels {meta['kernels']}, liger {meta['liger_kernel']}; {meta['git_sha']}")
    if args.json:
        command = shlex.join(["python", "-m", "ports.harness.hf_bench", *(
            sys.argv[1:] if argv is None else argv)])
        write_data_file(args.json, rows, meta, command)
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
