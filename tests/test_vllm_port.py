"""The vLLM port's host side on the CPU: the original's checks and the port's added ones (each a
named exception before any launch), the block-size rule, the kernel list, the position check, and
the registry adapter proven against the float64 oracle through tests/_vllm_reference.py. The
kernel compiles for sm_90 in tests/test_compile_cuda.py and runs in tests/test_gpu_vllm_port.py."""
from __future__ import annotations

import pytest
import torch

from _vllm_reference import cache_for, rotate_tokens
from ports import registry, vllm_port
from ports.vllm_port import _launch
from ports.vllm_port.canonical import cache_of, token_positions
from reference.case import RopeCase, make_inputs
from reference.oracle import rope_oracle

T, H, HK, D = 6, 4, 2, 16
I64 = torch.int64


def _call(positions=None, query=None, key="default", head_size=D, cache=None, **kw):
    pos = torch.arange(T, dtype=I64) if positions is None else positions
    q = torch.randn(T, H, D) if query is None else query
    k = torch.randn(T, HK, D) if isinstance(key, str) else key
    c = cache_for(32, D) if cache is None else cache
    return lambda: vllm_port.rotary_embedding(pos, q, k, head_size, c, True, **kw)


BAD = {
    "positions rank 3": (_call(positions=torch.zeros(1, 2, 3, dtype=I64)), ValueError,
                         "positions must have shape"),
    "token count": (_call(query=torch.randn(T + 1, H, D)), ValueError, "same number of tokens"),
    "batch and seq": (_call(positions=torch.zeros(2, 3, dtype=I64), query=torch.randn(3, 2, H, D),
                            key=None), ValueError, "batch_size and seq_len"),
    "head_size": (_call(head_size=0), ValueError, "head_size"),
    "rope_dim_offset": (_call(rope_dim_offset=-1), ValueError, "rope_dim_offset"),
    "positions int32": (_call(positions=torch.arange(T, dtype=torch.int32)), TypeError, "int64"),
    "query fp64": (_call(query=torch.randn(T, H, D, dtype=torch.float64), key=None), TypeError,
                   "float32, float16, bfloat16"),
    "key dtype": (_call(key=torch.randn(T, HK, D, dtype=torch.float16)), TypeError,
                  "query's type"),
    "cache fp64": (_call(cache=cache_for(32, D, dtype=torch.float64)), TypeError, "cos_sin_cache"),
    "cache rank": (_call(cache=torch.zeros(32, 1, D)), ValueError, "max_position, rot_dim"),
    "query rank": (_call(query=torch.randn(T, H, 2, D)), ValueError, "token dims"),
    "hidden not a multiple": (_call(query=torch.randn(T, H * D + 1)), ValueError, "multiple"),
    "head dim vs head_size": (_call(query=torch.randn(T, H, D + 2)), ValueError, "head_size"),
    "last dim strided": (_call(query=torch.randn(T, H, 2 * D)[..., ::2]), ValueError,
                         "last dim must be contiguous"),
    "batch stride": (_call(positions=torch.zeros(2, 3, dtype=I64),
                           query=torch.randn(2, 4, H, D)[:, :3], key=None), ValueError,
                     "batch stride"),
    "key with 0 heads": (_call(key=torch.randn(T, 0, D)), ValueError, "no heads"),
    "heads not a multiple": (_call(key=torch.randn(T, 3, D)), ValueError, "not a multiple"),
    "rot_dim past head": (_call(cache=cache_for(32, D), rope_dim_offset=2), ValueError,
                          "exceeds head_size"),
    "odd rot_dim": (_call(cache=torch.zeros(32, 7)), ValueError, "even"),
    "cache strided": (_call(cache=cache_for(32, 2 * D)[:, ::2]), ValueError, "contiguous"),
    "positions strided": (_call(positions=torch.arange(2 * T, dtype=I64)[::2]), ValueError,
                          "contiguous"),
    "key head stride": (_call(query=torch.randn(T, H * D), key=torch.randn(T, HK, 2 * D)[..., :D]),
                        ValueError, "head stride"),
    "cpu tensors": (_call(), ValueError, "CUDA tensor"),
}


@pytest.mark.parametrize("name", BAD)
def test_refusals_are_named_exceptions(name):
    call, exc, words = BAD[name]
    with pytest.raises(exc, match=words):
        call()


def test_empty_input_returns_before_any_launch():
    q = torch.randn(0, H, D)
    assert vllm_port.rotary_embedding(torch.zeros(0, dtype=I64), q, None, D, cache_for(4, D),
                                      True) is None


def test_position_check_names_the_range():
    _launch.check_positions(torch.tensor([0, 31]), 32)
    for bad in ([0, 32], [-1, 3]):
        with pytest.raises(ValueError, match="valid positions are 0..31"):
            _launch.check_positions(torch.tensor(bad), 32)


def test_block_is_one_thread_per_query_pair_capped_at_512():
    assert _launch.block_size(1, 64) == 32
    assert _launch.block_size(8, 128) == 512
    assert _launch.block_size(32, 128) == 512
    assert _launch.block_size(3, 10) == 15


def test_every_dispatched_pair_is_compiled():
    assert len(_launch.MODULE.kernels) == 3 * 3 * 2
    assert _launch.kernel_name(torch.bfloat16, torch.float32, False) in _launch.MODULE.kernels


def test_hand_checked_pairs():
    """Angle pi/2 at position 1: NeoX maps (x0, x2) -> (-x2, x0); GPT-J (x0, x1) -> (-x1, x0)."""
    cache = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]], dtype=torch.float64)
    pos = torch.tensor([1])
    assert rotate_tokens(x, pos, cache, is_neox=True).tolist() == [[[-3.0, -4.0, 1.0, 2.0]]]
    assert rotate_tokens(x, pos, cache, is_neox=False).tolist() == [[[-2.0, 1.0, -4.0, 3.0]]]
    assert rotate_tokens(x, pos, cache, is_neox=False, inverse=True).tolist() == \
        [[[2.0, -1.0, 4.0, -3.0]]]


CASES = [RopeCase(2, 9, 4, 32, kv_heads=2, positions="ids", label="ids"),
         RopeCase(2, 9, 4, 32, layout="sbhd", style="interleaved", positions="offset",
                  max_position=64, label="sbhd"),
         RopeCase(3, 9, 2, 32, layout="thd", seqlens=(9, 1, 4), rotary_dim=16, label="thd")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.describe())
def test_adapter_inputs_reproduce_the_oracle(case):
    """The registry's cache and token order, fed to the op's float64 semantics, give the oracle's
    answer: the row compares on the case's own inputs."""
    inputs = make_inputs(case)
    cache = cache_of(case, inputs)
    pos = token_positions(case, inputs)
    x = inputs.xs[0]
    tokens = x if case.layout == "thd" else x.flatten(0, 1)
    got = rotate_tokens(tokens, pos, cache, is_neox=case.style == "rotate_half")
    want = rope_oracle(x, inputs.cos, inputs.sin, inputs.positions, layout=case.layout,
                       style=case.style)
    want = want if case.layout == "thd" else want.flatten(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_registry_row():
    spec = registry.get("vllm_port.rotary_embedding")
    assert spec.family == "vllm_port" and spec.tensors_per_launch == 2
    base = RopeCase(2, 8, 4, 32, kv_heads=2)
    assert spec.unsupported_reason(base) is None
    assert spec.unsupported_reason(base.replace(layout="sbhd")) is None
    assert "layout bhsd" in spec.unsupported_reason(base.replace(layout="bhsd"))
    assert spec.unsupported_reason(base.replace(direction="backward")) == "no backward"
    assert "no v" in spec.unsupported_reason(base.replace(with_v=True))
    assert "not accepted" in spec.unsupported_reason(base.replace(cos_sin_dtype="fp64"))


def test_registry_row_checks_positions_once_and_times_the_original_work(monkeypatch):
    """The row reads the positions' range once while building its call; the timed call skips
    the port's sync (``check_positions_on_host=False``), as the original has none."""
    case = RopeCase(2, 8, 4, 32, kv_heads=2)
    calls, checked = [], []
    monkeypatch.setattr(vllm_port, "rotary_embedding", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(vllm_port, "check_positions", lambda *a: checked.append(a))
    fn = registry.get("vllm_port.rotary_embedding").prepare(case, make_inputs(case, 0))
    assert len(checked) == 1
    fn()
    fn()
    assert len(checked) == 1
    assert [kw["check_positions_on_host"] for kw in calls] == [False, False]
