"""Context parallelism across processes: every rank rotates its shard of q and k, the shards are
all-gathered and put back in order, and the result must equal the whole batch's rotation bit for
bit (torch.equal), forward (q, k) and backward (dq, dk from a random dy).

Run under torchrun from the repository root::

    torchrun --standalone --nproc_per_node=2 tests/_cp_worker.py --backend nccl  # 2 GPUs
    torchrun --standalone --nproc_per_node=2 tests/_cp_worker.py --backend gloo  # the CPU

``nccl`` rotates with ``ports.fastrope.apply_rope``; ``gloo`` with the float64 reference rotation
(reference.oracle), rounded to the inputs' dtype, so the plumbing runs on a machine without a
GPU. The cases: split scheme (contiguous, zigzag) x layout (bshd; thd with uneven sequence
lengths) x dtype (bf16, fp32); q with 8 heads, k with 2 (GQA), cos/sin tables whose two pair
members differ, so a backward that used the wrong member's sine would show. bshd rotates
rotate-half pairs, thd interleaved ones. The whole-batch rotation is given no positions for
fastrope (its own 0..S-1 per sequence) and make_inputs' positions for the reference, so neither
baseline depends on the split's arithmetic. Rank 0 prints one line per case; every rank exits 1
if any case differs, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

# Run as a script, Python puts tests/ on the path, not the repository root the package sits in.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ports.fastrope import apply_rope
from ports.fastrope.context_parallel import SCHEMES, ContextSplit
from reference.case import RopeCase, RopeInputs, make_inputs
from reference.oracle import rope_oracle
from reference.vocabulary import BSH_AXES

LAYOUTS = ("bshd", "thd")
DTYPES = ("bf16", "fp32")
SEQLEN_UNITS = (3, 9, 1, 5)  # thd: each sequence's length in units of 2 * world_size tokens


def torchrun_command(backend: str, nproc: int = 2) -> list[str]:
    """The command that runs this worker on ``nproc`` local processes (from the repository root)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", os.path.relpath(__file__, ROOT), "--backend", backend]


def make_case(layout: str, dtype: str, world_size: int, scale: int) -> RopeCase:
    """A backward case whose every sequence length is a multiple of ``2 * world_size`` (both
    splits cut it evenly); ``scale`` multiplies the lengths (GPU runs use longer ones)."""
    unit = 2 * world_size * scale
    common = dict(heads=8, kv_heads=2, head_dim=64, dtype=dtype, asymmetric=True,
                  direction="backward")
    if layout == "thd":
        seqlens = tuple(n * unit for n in SEQLEN_UNITS)
        return RopeCase(batch=len(seqlens), seqlen=max(seqlens), layout="thd", seqlens=seqlens,
                        style="interleaved", **common)
    return RopeCase(batch=2, seqlen=16 * unit, layout=layout, style="rotate_half", **common)


def split_for(case: RopeCase, inputs: RopeInputs, scheme: str, world_size: int,
              device) -> ContextSplit:
    """The split of the case's sequences (thd: by make_inputs' cu_seqlens)."""
    if case.layout == "thd":
        return ContextSplit(world_size=world_size, scheme=scheme, layout="thd",
                            cu_seqlens=inputs.cu_seqlens, device=device)
    return ContextSplit(world_size=world_size, scheme=scheme, layout=case.layout,
                        seqlen=case.seqlen, device=device)


def rotate_reference(q, k, case: RopeCase, cos, sin, *, positions, cu_seqlens=None,
                     max_seqlen=None):
    """The float64 reference rotation of q and k, rounded to their dtype (differentiable).

    ``positions`` as ``apply_rope`` takes them: per token, ``[s]`` or ``[b, s]`` (thd ``[t]``);
    ``cu_seqlens`` and ``max_seqlen`` are accepted for the same call and not needed.
    """
    if case.layout != "thd" and positions.dim() == 1:
        positions = positions.expand(q.shape[BSH_AXES[case.layout][0]], -1)
    return tuple(rope_oracle(x, cos, sin, positions, layout=case.layout, style=case.style
                             ).to(x.dtype) for x in (q, k))


def rotate_fastrope(q, k, case: RopeCase, cos, sin, **arguments):
    """fastrope's rotation of q and k (``arguments``: positions, cu_seqlens, max_seqlen)."""
    return apply_rope(q, k, cos=cos, sin=sin, layout=case.layout, style=case.style, **arguments)


def whole_arguments(backend: str, case: RopeCase, inputs: RopeInputs, device) -> dict:
    """The whole batch's rotation arguments: fastrope counts positions itself (0..S-1 in each
    sequence); the reference takes make_inputs' positions."""
    if backend == "gloo":
        return {"positions": inputs.positions.to(device)}
    return {} if case.layout != "thd" else {"cu_seqlens": inputs.cu_seqlens.to(device)}


def rotate_with_grads(rotate, q, k, dy, case, cos, sin, arguments):
    """(q', k', dq, dk): the rotation of q and k and its backward for the upstream grads dy."""
    q = q.detach().clone().requires_grad_(True)
    k = k.detach().clone().requires_grad_(True)
    out = rotate(q, k, case, cos, sin, **arguments)
    grads = torch.autograd.grad(out, (q, k), dy)
    return tuple(t.detach().contiguous() for t in (*out, *grads))


def run_case(backend, scheme, case, rank, world_size, device, seed) -> tuple[str, bool]:
    """One case on this rank: (a line for the log, whether all four tensors are equal)."""
    rotate = rotate_reference if backend == "gloo" else rotate_fastrope
    inputs = make_inputs(case, seed=seed)  # on the CPU: every rank draws the same tensors
    q, k = (x.to(device) for x in inputs.xs)
    dy = tuple(g.to(device) for g in inputs.grads)
    cos, sin = inputs.cos.to(device), inputs.sin.to(device)
    whole = rotate_with_grads(rotate, q, k, dy, case, cos, sin,
                              whole_arguments(backend, case, inputs, device))

    split = split_for(case, inputs, scheme, world_size, device)
    mine = split.rank_shard(rank)
    local = rotate_with_grads(rotate, split.shard(q, rank), split.shard(k, rank),
                              tuple(split.shard(g, rank) for g in dy), case, cos, sin,
                              mine.rope_arguments())
    verdicts = []
    for name, part, ref in zip(("q", "k", "dq", "dk"), local, whole):
        poisoned = [torch.full_like(part, float("nan")) for _ in range(world_size)]
        gathered = split.all_gather(part, buffers=poisoned)
        same = torch.equal(gathered, ref)
        diff = "" if same else f" (max |diff| {(gathered.double() - ref).abs().max():.3g})"
        verdicts.append((same, f"{name} {'equal' if same else 'DIFFERS'}{diff}"))
    ok = all(same for same, _ in verdicts)
    line = (f"{scheme:10s} {case.layout} {case.dtype} {case.style:11s} "
            f"{'x'.join(map(str, q.shape))}: " + ", ".join(text for _, text in verdicts))
    return line, ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), required=True,
                        help="nccl: fastrope on one GPU per rank; gloo: the reference on the CPU")
    parser.add_argument("--scale", type=int, default=None,
                        help="sequence length multiplier (default: 64 on GPU, 1 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    problem = None
    if "RANK" not in os.environ:
        problem = ("RANK and WORLD_SIZE are unset: run under torchrun, e.g. torchrun "
                   "--standalone --nproc_per_node=2 tests/_cp_worker.py --backend gloo")
    elif args.scale is not None and args.scale < 1:
        problem = f"--scale must be a positive int, got {args.scale}"
    elif args.backend == "nccl" and not torch.cuda.is_available():
        problem = "--backend nccl needs CUDA GPUs; use --backend gloo on the CPU"
    elif args.backend == "nccl" and int(os.environ.get("LOCAL_RANK", "0")) \
            >= torch.cuda.device_count():
        problem = (f"local rank {os.environ.get('LOCAL_RANK')} has no GPU "
                   f"({torch.cuda.device_count()} visible): start at most one process per GPU")
    if problem:
        print(f"_cp_worker.py: {problem}", file=sys.stderr)
        return 2
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    scale = args.scale or (64 if args.backend == "nccl" else 1)

    # a rank that dies is seen by torchrun, which stops the others; the timeout bounds the rest
    dist.init_process_group(args.backend, timeout=datetime.timedelta(minutes=2))
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        failures = 0
        if rank == 0:
            what = "fastrope" if args.backend == "nccl" else "the float64 reference (rounded)"
            print(f"context parallel: {world_size} ranks, {args.backend}, rotation by {what}")
        for i, (scheme, layout, dtype) in enumerate(
                (s, lay, d) for s in SCHEMES for lay in LAYOUTS for d in DTYPES):
            case = make_case(layout, dtype, world_size, scale)
            line, ok = run_case(args.backend, scheme, case, rank, world_size, device,
                                seed=args.seed + i)
            failures += not ok
            if rank == 0:
                print(line, flush=True)
        verdict = torch.tensor([failures], dtype=torch.int64, device=device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)  # every rank exits alike
        if rank == 0:
            print("all equal" if not int(verdict) else f"{int(verdict)} case(s) differ "
                  "(on some rank)")
        return 1 if int(verdict) else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
