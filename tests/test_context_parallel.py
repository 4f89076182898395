"""Context parallelism (ports/fastrope/context_parallel.py) on the CPU.

The splits by hand on small examples (Megatron's and TE's zigzag order); shard/unshard round
trips for every layout, scheme and a few world sizes; each shard's positions against the global
positions make_inputs draws; the float64 reference rotation of the shards, reassembled, equal to
the whole batch's bit for bit, forward and backward (and unequal when a shard is given the other
split's positions: TE's thd bug, which assumed zigzag); clear errors; all_gather on a one-rank
group; and the distributed worker (tests/_cp_worker.py) on 2 processes with gloo. The same
worker on 2 GPUs with NCCL and fastrope: tests/test_gpu_context_parallel.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from _cp_worker import (ROOT, make_case, rotate_reference, rotate_with_grads, split_for,
                        torchrun_command, whole_arguments)

from ports.fastrope.context_parallel import SCHEMES, ContextSplit
from reference.case import make_inputs
from reference.layouts import shape_of
from reference.vocabulary import LAYOUTS, TOKEN_AXIS

# thd boundaries with uneven lengths (8, 16, 0, 24): multiples of 2W for W = 1, 2, 4
CU_SEQLENS = [0, 8, 24, 24, 48]


def _split(layout: str, scheme: str, world_size: int) -> ContextSplit:
    if layout == "thd":
        return ContextSplit(world_size=world_size, scheme=scheme, layout="thd",
                            cu_seqlens=torch.tensor(CU_SEQLENS, dtype=torch.int32))
    return ContextSplit(world_size=world_size, scheme=scheme, layout=layout, seqlen=16)


def _whole(split: ContextSplit, layout: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    shape = shape_of(layout, 3, split.tokens, 2, 4, total_tokens=split.tokens)
    return torch.randn(shape, generator=gen)


# ---- the splits by hand ----------------------------------------------------------------------
@pytest.mark.parametrize("scheme, expected", [
    ("contiguous", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("zigzag", [[0, 1, 6, 7], [2, 3, 4, 5]]),  # chunks (0, 3) and (1, 2) of 4
])
def test_dense_split_by_hand(scheme, expected):
    split = ContextSplit(world_size=2, scheme=scheme, layout="bshd", seqlen=8)
    for rank, tokens in enumerate(expected):
        shard = split.rank_shard(rank)
        assert shard.index.tolist() == tokens
        assert shard.positions.tolist() == tokens
        assert shard.cu_seqlens is None and shard.max_seqlen is None
        assert shard.rope_arguments().keys() == {"positions"}


@pytest.mark.parametrize("scheme, expected", [
    # sequences [0, 8), [8, 8) (empty), [8, 12): rank 0 then rank 1
    ("contiguous", [([0, 1, 2, 3, 8, 9], [0, 1, 2, 3, 0, 1]),
                    ([4, 5, 6, 7, 10, 11], [4, 5, 6, 7, 2, 3])]),
    ("zigzag", [([0, 1, 6, 7, 8, 11], [0, 1, 6, 7, 0, 3]),
                ([2, 3, 4, 5, 9, 10], [2, 3, 4, 5, 1, 2])]),
])
def test_thd_split_by_hand(scheme, expected):
    split = ContextSplit(world_size=2, scheme=scheme, layout="thd", cu_seqlens=[0, 8, 8, 12])
    for rank, (tokens, positions) in enumerate(expected):
        shard = split.rank_shard(rank)
        assert shard.index.tolist() == tokens
        assert shard.positions.tolist() == positions
        assert shard.cu_seqlens.dtype == torch.int32
        assert shard.cu_seqlens.tolist() == [0, 4, 4, 6]
        assert shard.max_seqlen == 4
        assert shard.rope_arguments().keys() == {"positions", "cu_seqlens", "max_seqlen"}


def test_zigzag_matches_megatron_reshape():
    """Megatron's own form: view the sequence as [2W, S/2W], keep chunks r and 2W-1-r."""
    w, s = 4, 32
    split = ContextSplit(world_size=w, scheme="zigzag", layout="bshd", seqlen=s)
    chunks = torch.arange(s).view(2 * w, s // (2 * w))
    for rank in range(w):
        expected = chunks.index_select(0, torch.tensor([rank, 2 * w - rank - 1])).flatten()
        assert torch.equal(split.rank_shard(rank).index, expected)


# ---- round trips and positions ---------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_unshard_round_trip(layout, scheme, world_size):
    split = _split(layout, scheme, world_size)
    x = _whole(split, layout)
    shards = [split.shard(x, r) for r in range(world_size)]
    # every token on exactly one rank, each rank the same count
    order = torch.cat([split.rank_shard(r).index for r in range(world_size)])
    assert torch.equal(order.sort().values, torch.arange(split.tokens))
    assert len({s.shape[TOKEN_AXIS[layout]] for s in shards}) == 1
    for r, s in enumerate(shards):
        assert torch.equal(s, x.index_select(TOKEN_AXIS[layout], split.rank_shard(r).index))
    assert torch.equal(split.unshard(shards), x)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
def test_shard_positions_are_global_positions(layout, scheme):
    """Each rank's positions equal make_inputs' positions (0..n-1 per sequence) of its tokens."""
    case = make_case("thd" if layout == "thd" else "bshd", "fp32", world_size=4, scale=1)
    inputs = make_inputs(case)
    split = split_for(case.replace(layout=layout) if layout == "sbhd" else case, inputs, scheme,
                      4, "cpu")
    for rank in range(4):
        mine = split.rank_shard(rank)
        theirs = split.shard_positions(inputs.positions, rank)  # [b, s_local] or [t_local]
        assert torch.equal(theirs, mine.positions.expand_as(theirs))
        if layout == "thd":
            local = torch.tensor(case.seqlens) // 4
            assert mine.cu_seqlens.tolist() == [0, *torch.cumsum(local, 0).tolist()]
            assert mine.max_seqlen == max(case.seqlens) // 4


def test_unshard_is_differentiable():
    split = _split("thd", "zigzag", 2)
    x = _whole(split, "thd").requires_grad_(True)
    whole = split.unshard([split.shard(x, r) * (r + 1) for r in range(2)])
    (grad,) = torch.autograd.grad(whole, x, torch.ones_like(whole))
    expected = torch.ones_like(x)
    expected[split.rank_shard(1).index] = 2
    assert torch.equal(grad, expected)


# ---- the sharded rotation equals the whole one -----------------------------------------------
def _sharded_rotation(case, inputs, split, world_size, positions_of):
    """Every rank's reference rotation (with grads) of its shard, reassembled."""
    parts = []
    for rank in range(world_size):
        arguments = {"positions": positions_of(rank)}
        parts.append(rotate_with_grads(
            rotate_reference, split.shard(inputs.xs[0], rank), split.shard(inputs.xs[1], rank),
            tuple(split.shard(g, rank) for g in inputs.grads), case, inputs.cos, inputs.sin,
            arguments))
    return [split.unshard([p[i] for p in parts]) for i in range(4)]  # q, k, dq, dk


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_sharded_rotation_equals_whole(dtype, layout, scheme, world_size):
    case = make_case(layout, dtype, world_size=world_size, scale=1)
    inputs = make_inputs(case, seed=3)
    whole = rotate_with_grads(rotate_reference, *inputs.xs, inputs.grads, case, inputs.cos,
                              inputs.sin, whole_arguments("gloo", case, inputs, "cpu"))
    split = split_for(case, inputs, scheme, world_size, "cpu")
    gathered = _sharded_rotation(case, inputs, split, world_size,
                                 lambda r: split.rank_shard(r).positions)
    for name, got, ref in zip(("q", "k", "dq", "dk"), gathered, whole):
        assert torch.equal(got, ref), name


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_the_other_splits_positions_differ(layout):
    """The comparison can fail: a zigzag shard rotated at the contiguous split's positions (and a
    contiguous one at zigzag's, TE's thd assumption) is not the whole rotation."""
    case = make_case(layout, "fp32", world_size=2, scale=1)
    inputs = make_inputs(case, seed=3)
    whole = rotate_with_grads(rotate_reference, *inputs.xs, inputs.grads, case, inputs.cos,
                              inputs.sin, whole_arguments("gloo", case, inputs, "cpu"))
    for scheme, other in (("zigzag", "contiguous"), ("contiguous", "zigzag")):
        split = split_for(case, inputs, scheme, 2, "cpu")
        wrong = split_for(case, inputs, other, 2, "cpu")
        gathered = _sharded_rotation(case, inputs, split, 2,
                                     lambda r: wrong.rank_shard(r).positions)
        for name, got, ref in zip(("q", "k", "dq", "dk"), gathered, whole):
            assert not torch.equal(got, ref), (scheme, name)


# ---- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(world_size=0), ValueError, "world_size must be >= 1, got 0"),
    (dict(world_size="2"), TypeError, "world_size must be an int, got str"),
    (dict(world_size=True), TypeError, "world_size must be an int, got bool"),
    (dict(scheme="ring"), ValueError, r"unknown scheme 'ring'; expected one of \('contiguous', "),
    (dict(layout="bsd"), ValueError, "unknown layout 'bsd'"),
    (dict(seqlen=None), ValueError, "layout 'bshd' needs seqlen"),
    (dict(seqlen=-4), ValueError, "seqlen must be >= 0"),
    (dict(seqlen=12), ValueError, r"the sequence length 12 is not a multiple of 8 \(zigzag split "
                                  "over 4 ranks cuts each sequence into 8 equal chunks\\); pad"),
    (dict(scheme="contiguous", seqlen=10), ValueError, "length 10 is not a multiple of 4 "),
    (dict(cu_seqlens=[0, 8]), ValueError, "cu_seqlens only applies to layout 'thd'"),
    (dict(layout="thd", seqlen=None), ValueError, "layout 'thd' needs cu_seqlens"),
    (dict(layout="thd"), ValueError, "layout 'thd' takes cu_seqlens, not seqlen"),
    (dict(layout="thd", seqlen=None, cu_seqlens=[0, 8, 20, 28]), ValueError,
     "sequence 1's length 12 is not a multiple of 8"),
    (dict(layout="thd", seqlen=None, cu_seqlens=[0, 16, 8]), ValueError,
     r"cu_seqlens must rise from 0 .*got \[0, 16, 8\]"),
    (dict(layout="thd", seqlen=None, cu_seqlens=[8, 16]), ValueError, "must rise from 0"),
    (dict(layout="thd", seqlen=None, cu_seqlens=[0]), ValueError, "at least two entries"),
    (dict(layout="thd", seqlen=None, cu_seqlens=torch.tensor([0.0, 8.0])), ValueError,
     "cu_seqlens must be a 1-D int32 or int64 tensor, got torch.float32"),
    (dict(layout="thd", seqlen=None, cu_seqlens=[0, 8.0]), TypeError, "sequence of ints"),
])
def test_bad_split_raises(kwargs, error, match):
    arguments = dict(world_size=4, scheme="zigzag", layout="bshd", seqlen=16) | kwargs
    with pytest.raises(error, match=match):
        ContextSplit(**arguments)


def test_bad_rank_and_tensors_raise():
    split = ContextSplit(world_size=2, scheme="zigzag", layout="bshd", seqlen=8)
    x = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=r"rank 2 is out of range for world_size 2; expected "
                                         r"0 <= rank < 2"):
        split.shard(x, 2)
    with pytest.raises(ValueError, match="rank must be >= 0, got -1"):
        split.rank_shard(-1)
    with pytest.raises(TypeError, match="rank must be an int, got float"):
        split.rank_shard(1.0)
    with pytest.raises(ValueError, match=r"x has 6 tokens along axis 1 but the split covers 8"):
        split.shard(torch.randn(1, 6, 2, 4), 0)
    with pytest.raises(ValueError, match=r"x must be 4-D \[b, s, h, d\] for layout 'bshd'"):
        split.shard(torch.randn(8, 2, 4), 0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        split.shard([1, 2], 0)
    shards = [split.shard(x, r) for r in range(2)]
    with pytest.raises(ValueError, match="sequence of 2 shards, one per rank in rank order, "
                                         "got 1"):
        split.unshard(shards[:1])
    with pytest.raises(ValueError, match="got a tensor"):
        split.unshard(torch.cat(shards, 1))
    with pytest.raises(ValueError, match=r"shard 1 must be 4-D \[b, s, h, d\] with 4 tokens "
                                         r"along axis 1, got shape \(1, 8, 2, 4\)"):
        split.unshard([shards[0], x])
    with pytest.raises(ValueError, match=r"got shape \(4, 2, 4\)"):
        split.unshard([shards[0], shards[1][0]])
    with pytest.raises(ValueError, match=r"positions must be \[s\] or \[b, s\] with 8 tokens"):
        split.shard_positions(torch.arange(6), 0)


@pytest.fixture
def one_rank_group(tmp_path):
    """A torch.distributed group of this process alone (gloo), destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_all_gather_on_one_rank(one_rank_group):
    split = ContextSplit(world_size=1, scheme="zigzag", layout="thd", cu_seqlens=CU_SEQLENS)
    x = _whole(split, "thd")
    assert torch.equal(split.all_gather(split.shard(x, 0)), x)
    buffers = [torch.full_like(x, float("nan"))]
    assert torch.equal(split.all_gather(x, buffers=buffers), x)
    assert torch.equal(buffers[0], x)  # received into the caller's buffer
    with pytest.raises(ValueError, match=r"buffers must be 1 contiguous tensors of local's "
                                         r"shape \(48, 2, 4\), dtype and device"):
        split.all_gather(x, buffers=[x.double()])
    with pytest.raises(TypeError, match="local must be a torch.Tensor, got list"):
        split.all_gather([x])
    two = ContextSplit(world_size=2, scheme="zigzag", layout="thd", cu_seqlens=CU_SEQLENS)
    with pytest.raises(ValueError, match="the process group has 1 ranks but the split has "
                                         "world_size 2"):
        two.all_gather(two.shard(x, 0))


# ---- the distributed worker on the CPU -------------------------------------------------------
def test_worker_refuses_to_run_outside_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "tests/_cp_worker.py", "--backend", "gloo"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "_cp_worker.py: RANK and WORLD_SIZE are unset: run under torchrun, e.g. torchrun "
        "--standalone --nproc_per_node=2 tests/_cp_worker.py --backend gloo"]


def test_two_processes_gloo_reference():
    """Two ranks on the CPU (gloo) shard, rotate with the reference, all-gather, reorder: every
    case equals the whole rotation bit for bit."""
    proc = subprocess.run(torchrun_command("gloo"), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("context parallel: 2 ranks, gloo")
    assert len(lines) == 2 + 2 * 2 * 2, proc.stdout  # header, the cases, the verdict
    assert all(line.endswith("q equal, k equal, dq equal, dk equal") for line in lines[1:-1])
    assert lines[-1] == "all equal"
