"""The installed peers on the GPU: every peer that imports here, through its adapter, against the
float64 oracle on the peers suite's kinds of case (small sizes) and on the bug classes their
users hit (GPT-J pairs, partial rotary, offsets, ids, thd, strided q, GQA k, backward). A peer
that is not installed skips with its ``not installed`` line; flash-attn's rotary may come from
the file at $ROPE_PORTS_FLASH_ATTN_ROTARY. TE and vLLM are tested on the CPU against stand-ins
(tests/test_peers.py): their wheels are not carried to the GPU machine.
"""
from __future__ import annotations

import pytest
import torch

from ports import registry
from ports.harness.runner import run_case
from reference.case import RopeCase

pytestmark = pytest.mark.gpu

PEERS = [s.name for s in registry.REGISTRY if s.kind == "peer"]
SMALL = RopeCase(2, 33, 8, 64, dtype="bf16", cos_sin_dtype="same", kv_heads=2, label="small")
CASES = [
    SMALL, SMALL.replace(dtype="fp16"), SMALL.replace(dtype="fp32"),
    SMALL.replace(cos_sin_dtype="fp32"),
    SMALL.replace(style="interleaved"), SMALL.replace(rotary_dim=32, positions="offset",
                                                      max_position=4096),
    SMALL.replace(positions="ids"), SMALL.replace(contiguous=False),
    SMALL.replace(layout="sbhd"), SMALL.replace(layout="bhsd"),
    RopeCase(3, 40, 8, 64, layout="thd", seqlens=(40, 1, 17), dtype="bf16",
             cos_sin_dtype="same", kv_heads=2),
    RopeCase(64, 1, 32, 128, dtype="bf16", cos_sin_dtype="same", kv_heads=8,
             positions="offset", max_position=4096, label="decode"),
    SMALL.replace(direction="backward"), SMALL.replace(direction="backward", grad="broadcast"),
]


@pytest.mark.parametrize("name", PEERS)
def test_installed_peer_passes_every_case_it_supports(name):
    spec = registry.get(name)
    missing = spec.missing() if spec.missing else None
    if missing:
        pytest.skip(missing)
    ran = 0
    for case in CASES:
        rep = run_case(case, [spec], timing_on=False)
        r = rep.results[0]
        assert r.status in ("ok", "unsupported"), (case.describe(), r.status, r.reason)
        ran += r.status == "ok"
    assert ran, f"{name} supported none of the cases"


def test_peers_suite_times_every_installed_peer_beside_the_ports():
    from ports.harness.suites import get_suite

    case = get_suite("peers")[-1]  # the bf16 decode step (b=64)
    specs = registry.select(None)
    rep = run_case(case, specs, graph=True)
    assert not rep.failed, [(r.impl, r.reason) for r in rep.results if r.status in
                            ("FAIL", "error")]
    timed = [r for r in rep.results if r.graph_us is not None]
    assert min(r.graph_vs_fastest for r in timed) == 1.0
    assert torch.cuda.is_available()
