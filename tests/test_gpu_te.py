"""The TE port on the GPU, against the float64 oracle of its fp32 angles.

Through the registry (every layout, both conventions, partial rotary, start positions, strided
input, backward with random and zero-stride gradients, thd on both grids) and directly: context
parallelism's dual-chunk positions, the token-linear thd grid, the shared cos/sin reused across
heads (h >= 16: 8 warps), and the added refusals (start positions past the table). Outputs are
poisoned (NaN) first, so an element the kernel leaves unwritten fails.
"""
from __future__ import annotations

import pytest
import torch

from ports import _alloc, registry, te
from ports.harness.runner import run_case
from reference.case import RopeCase
from reference.oracle import rope_oracle
from reference.tolerances import tolerance

pytestmark = pytest.mark.gpu

BASE = RopeCase(2, 37, 5, 64, dtype="bf16", label="te")
CASES = [
    BASE, BASE.replace(dtype="fp16"), BASE.replace(dtype="fp32"),
    BASE.replace(style="interleaved"), BASE.replace(layout="sbhd", rotary_dim=32),
    BASE.replace(positions="offset", max_position=512), BASE.replace(contiguous=False),
    BASE.replace(heads=32, kv_heads=8, style="interleaved"),
    BASE.replace(direction="backward"), BASE.replace(direction="backward", grad="broadcast",
                                                     style="interleaved", rotary_dim=32),
    BASE.replace(direction="backward", positions="offset", max_position=512),
    RopeCase(4, 50, 4, 64, layout="thd", seqlens=(50, 1, 17, 30), dtype="bf16"),
    RopeCase(4, 50, 4, 64, layout="thd", seqlens=(50, 1, 17, 30), style="interleaved",
             direction="backward"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.describe())
def test_te_port_matches_the_oracle(case):
    specs = [s for s in registry.select(["te"]) if s.unsupported_reason(case) is None]
    assert specs
    rep = run_case(case, specs, timing_on=False)
    assert all(r.status == "ok" for r in rep.results), [(r.impl, r.reason) for r in rep.results]


def _freqs(rows, d2, style="rotate_half", base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, d2, 2, dtype=torch.float64) / d2)
    ang = torch.arange(rows, dtype=torch.float64)[:, None] * inv
    full = torch.cat([ang, ang], -1) if style == "rotate_half" else ang.repeat_interleave(2, -1)
    return full.float().view(rows, 1, 1, d2).cuda()


def _check(out, x, freqs, positions, layout, style):
    f = freqs[:, 0, 0, :].double().cpu()
    ref = rope_oracle(x.cpu(), torch.cos(f), torch.sin(f), positions.cpu(), layout=layout,
                      style=style)
    err = (out.cpu().double() - ref).abs()
    assert not torch.isnan(err).any()
    assert (err <= tolerance(ref, x.dtype, steps=2.0)).all(), float(err.max())


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_context_parallel_dual_chunk_positions(cp_rank):
    cp, total = 2, (16, 8)  # global sequence lengths; rank r holds chunks r and 2 * cp - 1 - r
    local = [n // cp for n in total]
    cu = torch.tensor([0, total[0], sum(total)], dtype=torch.int32, device="cuda")
    x = torch.randn(sum(local), 32, 64, device="cuda", dtype=torch.bfloat16)
    freqs = _freqs(32, 64)
    with _alloc.poisoned():
        out = te.apply_rotary_pos_emb(x, freqs, "thd", cu_seqlens=cu, cp_size=cp,
                                      cp_rank=cp_rank)
    pos = []
    for n in local:
        half = n // 2
        pos += [s + cp_rank * half if s < half else s + n * cp - (cp_rank + 1) * half - half
                for s in range(n)]
    _check(out, x, freqs, torch.tensor(pos), "thd", "rotate_half")


def test_token_linear_thd_grid():
    from ports.te import _launch

    lengths = [4096] + [1] * 63  # one long sequence: the (max_s, b) grid wastes ~258k blocks
    assert _launch.use_linear_grid(4096 * 64, sum(lengths), 1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    x = torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.float16)
    freqs = _freqs(4096, 64, "interleaved")
    with _alloc.poisoned():
        out = te.apply_rotary_pos_emb(x, freqs, "thd", cu_seqlens=cu, interleaved=True)
    pos = torch.cat([torch.arange(n) for n in lengths])
    _check(out, x, freqs, pos, "thd", "interleaved")


def test_start_positions_past_the_table_are_refused():
    x = torch.randn(2, 8, 2, 32, device="cuda")
    with pytest.raises(ValueError, match="read past"):
        te.apply_rotary_pos_emb(x, _freqs(10, 32), "bshd",
                                start_positions=torch.tensor([0, 3], dtype=torch.int32,
                                                             device="cuda"))


def test_start_positions_under_cuda_graph_capture():
    """The host cannot read start_positions while a graph is captured: the kernel bounds the
    freqs row instead (valid positions as before; one past the table gives NaN, no stray read)."""
    x = torch.randn(2, 8, 4, 32, device="cuda", dtype=torch.bfloat16)
    freqs = _freqs(16, 32)
    start = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    fn = lambda: te.apply_rotary_pos_emb(x, freqs, "bshd", start_positions=start)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs' writes first
    with torch.cuda.stream(stream):
        fn()  # warm-up (compiles) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fn()
    graph.replay()
    torch.cuda.synchronize()
    pos = (start.cpu().long()[:, None] + torch.arange(8)[None])
    _check(out, x, freqs, pos, "bshd", "rotate_half")
    start.fill_(9)  # now every sequence reaches row 16 at its last token: past the table
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[:, -1]).all() and not torch.isnan(out[:, :7]).any()
