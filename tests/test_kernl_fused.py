"""kernl's rmsnorm_triton and fused rms_matmul_rbe (seed 004) against float64 references.

The CPU tests run the kernels under the Triton interpreter (conftest sets TRITON_INTERPRET=1
without a GPU; it runs ``tl.dot`` on tiny fp32/fp16/bf16 tiles) on shapes that exercise the wrap
of rows past M and columns past N; the ``gpu`` tests use the blog's Llama-2-7B shapes, which the
interpreter would take far too long over (a 4096 x 4096 matmul in Python), and check compilation
and timing, which it does not do.
"""
from __future__ import annotations

import pytest
import torch

from conftest import HAS_GPU
from ports import _alloc
from ports.harness import cli, env, pipeline
from ports.harness.seed_suites import SEED_SUITES, seed000, seed002
from reference.vocabulary import DTYPES, KERNEL_DTYPES

pytestmark = pytest.mark.skipif(
    not ({"cuda", "interpret"} & env.targets()),
    reason="needs a GPU or TRITON_INTERPRET=1 (set by conftest before ports are imported)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The gpu tests' own reason (checked before conftest's generic one): they are Triton, not CuPy.
BLOG_SHAPES_NEED_A_GPU = pytest.mark.skipif(
    not HAS_GPU, reason="needs an NVIDIA GPU: the blog's Llama-2-7B shapes (a 4096 x 4096 "
                        "matmul) are too slow for the Triton interpreter, and compile counts and "
                        "timing need a real launch")
TOL = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 1e-2}  # normwise, whole pipeline
ONE_ROUNDING = {"fp32": 1e-6, "fp16": 1e-3, "bf16": 8e-3}  # normwise, one rounding (u = 2^-p)
# tiny: M = 3 (rows wrap in a 16-row tile), N = 48 = 3 heads x 16 (columns wrap in the 2nd
# 32-wide tile), K = 32 (two K steps of 16)
TINY = dict(b=2, M=3, heads=3, head_dim=16, K=32)
TINY_BLOCKS = dict(block_size_m=16, block_size_n=32, block_size_k=16)


def _inputs(b, M, heads, head_dim, K, dtype, seed=0, device=DEVICE):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    N = heads * head_dim

    def randn(*size, scale=1.0):
        return (torch.randn(size, generator=g, device=device) * scale).to(dtype)
    return randn(b, M, K), randn(N, K, scale=0.2), randn(K, scale=0.2) + 1


def _err(out, ref):
    return pipeline.normwise_rel_err(out, ref)


# ---- CPU (interpreter) or GPU: tiny shapes --------------------------------------------------
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_rmsnorm_triton(dtype):
    from ports import kernl

    x, _, rms_w = _inputs(2, 3, 1, 40, 40, DTYPES[dtype])  # K = 40: a masked second chunk of 32
    with _alloc.poisoned():
        out = kernl.rmsnorm_triton_wrapper(x, rms_w, block_n_size=32)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert _err(out, pipeline.reference_rmsnorm(x, rms_w)) < ONE_ROUNDING[dtype]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("use_rbe", [True, False], ids=["q_rbe", "v_plain"])
def test_rms_matmul_rbe(dtype, use_rbe):
    from ports import kernl

    s = TINY
    x, w, rms_w = _inputs(s["b"], s["M"], s["heads"], s["head_dim"], s["K"], DTYPES[dtype])
    if dtype == "bf16" and DEVICE == "cpu":
        with pytest.raises(NotImplementedError, match="interpreter"):
            kernl.rms_matmul_rbe_wrapper(x, w, rms_w, use_rbe, 7, s["heads"], s["head_dim"],
                                         **TINY_BLOCKS)
        pytest.skip("Triton's interpreter computes tl.dot on bf16 wrongly: bf16 is a GPU test")
    with _alloc.poisoned():
        out = kernl.rms_matmul_rbe_wrapper(x, w, rms_w, use_rbe, 7, s["heads"], s["head_dim"],
                                           **TINY_BLOCKS)
    assert out.shape == (s["b"], s["M"], s["heads"], s["head_dim"]) and out.dtype == x.dtype
    ref = pipeline.reference_pipeline(x, rms_w, w, 7, s["heads"], s["head_dim"], use_rbe)
    assert _err(out, ref) < TOL[dtype]
    if use_rbe:  # not the unrotated projection (the epilogue really ran)
        plain = pipeline.reference_pipeline(x, rms_w, w, 7, s["heads"], s["head_dim"], False)
        assert _err(out, plain) > 0.1


def test_rms_matmul_rbe_qkv_writes_into_the_cache():
    from ports import kernl

    s = TINY
    x, w, rms_w = _inputs(s["b"], s["M"], s["heads"], s["head_dim"], s["K"], torch.float16)
    wk, wv = (w.flip(0).contiguous(), (w * 0.5).contiguous())
    N = s["heads"] * s["head_dim"]
    cache_k = torch.full((s["b"], 10, N), float("nan"), dtype=x.dtype, device=x.device)
    cache_v = torch.full_like(cache_k, float("nan"))
    q, k, v = kernl.rms_matmul_rbe_qkv_wrapper(x, 4, w, wk, wv, rms_w, s["heads"], s["head_dim"],
                                               k=cache_k[:, 4:7], v=cache_v[:, 4:7],
                                               **TINY_BLOCKS)
    ref = pipeline.reference_pipeline
    assert _err(q, ref(x, rms_w, w, 4, s["heads"], s["head_dim"])) < 1e-2
    assert _err(k, ref(x, rms_w, wk, 4, s["heads"], s["head_dim"])) < 1e-2
    assert _err(v, ref(x, rms_w, wv, 4, s["heads"], s["head_dim"], use_rbe=False)) < 1e-2
    assert torch.equal(k.reshape(cache_k[:, 4:7].shape), cache_k[:, 4:7])
    assert torch.isnan(cache_k[:, :4]).all() and torch.isnan(cache_v[:, 7:]).all()


def test_pipeline_run_validates_every_implementation_on_a_tiny_shape():
    rows = pipeline.run(pipeline.tiny_shapes(), device=DEVICE, timing_on=False)
    assert {r.experiment for r in rows} == set(pipeline.EXPERIMENTS)
    assert len(rows) == len(pipeline.IMPLS)
    bad = [(r.impl, r.status, r.note) for r in rows if r.status != "ok"]
    assert not bad, bad
    for exp in pipeline.EXPERIMENTS:
        assert all(len(cells) == len(pipeline.HEADERS) for cells in pipeline.table_rows(rows, exp))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path of the CLI")
def test_pipeline_mode_without_a_gpu(capsys):
    assert cli.main(["--pipeline", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "No CUDA GPU" in text and "fused rms_matmul_rbe" in text and "FAIL" not in text
    assert max(map(len, text.splitlines())) <= 140


def test_pipeline_experiments_match_the_cli_choices():
    assert cli.PIPELINE_EXPERIMENTS == pipeline.EXPERIMENTS


def test_reference_pipeline_matches_kernl_eager_in_float64():
    """The float64 reference equals kernl's eager pipeline evaluated in float64."""
    from reference.eager import llama_apply_rotary_emb_real, precompute_freqs_cis_pytorch

    x, w, rms_w = _inputs(1, 5, 2, 8, 16, torch.float64, device="cpu")
    cos, sin = precompute_freqs_cis_pytorch(8, 12)
    y = (pipeline.rms_norm_pytorch(x, rms_w) @ w.t()).view(1, 5, 2, 8)
    eager = llama_apply_rotary_emb_real(y, cos[7:12].double(), sin[7:12].double())
    ref = pipeline.reference_pipeline(x, rms_w, w, 7, 2, 8)
    assert _err(eager, ref) < 1e-6  # the eager form casts its tables to fp32


# ---- bad inputs raise before launch ----------------------------------------------------------
def _bad_call(**changes):
    from ports import kernl

    s = TINY
    x, w, rms_w = _inputs(s["b"], s["M"], s["heads"], s["head_dim"], s["K"], torch.float16)
    args = dict(x=x, weight=w, rms_w=rms_w, use_rbe=True, start_pos=0, n_heads=s["heads"],
                head_dim=s["head_dim"], **TINY_BLOCKS)
    args.update(changes)
    return kernl.rms_matmul_rbe_wrapper(**args)


@pytest.mark.parametrize("changes, exc, words", [
    (dict(block_size_k=64), ValueError, "multiple of block_size_k"),
    (dict(block_size_m=8), ValueError, "tl.dot"),
    (dict(block_size_n=48), ValueError, "power of two"),
    (dict(n_heads=2), ValueError, "n_heads * head_dim"),
    (dict(start_pos=-1), ValueError, "start_pos"),
    (dict(start_pos=2**24), ValueError, "fp32"),
    (dict(eps=0.0), ValueError, "eps"),
    (dict(theta=float("inf")), ValueError, "theta"),
], ids=["K-not-multiple", "block-too-small", "block-not-pow2", "heads", "neg-pos", "pos-2^24",
        "eps", "theta"])
def test_fused_bad_arguments(changes, exc, words):
    with pytest.raises(exc, match=words.replace("*", r"\*").replace("^", r"\^")):
        _bad_call(**changes)


def test_fused_bad_tensors():
    s = TINY
    x, w, rms_w = _inputs(s["b"], s["M"], s["heads"], s["head_dim"], s["K"], torch.float16)
    with pytest.raises(TypeError, match="weight has dtype float32"):
        _bad_call(weight=w.float())
    with pytest.raises(TypeError, match="x has dtype int32"):
        _bad_call(x=x.to(torch.int32))
    with pytest.raises(ValueError, match="x's last dim"):
        _bad_call(weight=torch.zeros(48, 16, dtype=torch.float16, device=x.device))
    with pytest.raises(ValueError, match="rms_w has 16 elements"):
        _bad_call(rms_w=rms_w[:16])
    with pytest.raises(ValueError, match="3-D"):
        _bad_call(x=x[0])
    with pytest.raises(ValueError, match="out has shape"):
        _bad_call(out=torch.empty(5, dtype=torch.float16, device=x.device))
    from ports import kernl
    with pytest.raises(ValueError, match="share one shape"):
        kernl.rms_matmul_rbe_qkv_wrapper(x, 0, w, w[:16], w, rms_w, 3, 16, **TINY_BLOCKS)


def test_rmsnorm_bad_inputs():
    from ports import kernl

    x, _, rms_w = _inputs(1, 2, 1, 32, 32, torch.float16)
    with pytest.raises(ValueError, match="rms_w has 31"):
        kernl.rmsnorm_triton_wrapper(x, rms_w[:31])
    with pytest.raises(ValueError, match="power of two"):
        kernl.rmsnorm_triton_wrapper(x, rms_w, block_n_size=48)
    with pytest.raises(ValueError, match="eps"):
        kernl.rmsnorm_triton_wrapper(x, rms_w, eps=-1.0)
    with pytest.raises(TypeError, match="rms_w has dtype int64"):
        kernl.rmsnorm_triton_wrapper(x, rms_w.long())


# ---- the seeds' suites -----------------------------------------------------------------------
def test_seed_suites():
    cases = seed000()
    assert [c.seqlen for c in cases] == [1024, 2048, 4096, 8192]
    assert all((c.layout, c.batch, c.heads, c.head_dim, c.dtype) == ("sbhd", 2, 64, 256, "fp16")
               for c in cases)
    thin, full = seed002(), seed002(128)
    assert len(full) == 4 * 30 and {c.batch for c in full} == {1, 2, 4, 8}
    assert sorted({c.seqlen for c in full}) == list(range(256, 3969, 128))
    assert {c.seqlen for c in thin} == {256, 768, 1280, 1792, 2304, 2816, 3328, 3840, 3968}
    assert all((c.heads, c.head_dim, c.dtype, c.layout) == (64, 128, "fp32", "sbhd") for c in full)
    assert [c.seqlen for c in seed002([300])] == [300] * 4
    assert all(c.label.startswith(("te sweep", "batch-reuse sweep")) for name in SEED_SUITES
               for c in SEED_SUITES[name]())
    with pytest.raises(ValueError):
        seed002(100)


# ---- GPU: the blog's Llama-2-7B shapes -------------------------------------------------------
@pytest.mark.gpu
@BLOG_SHAPES_NEED_A_GPU
def test_gpu_blog_experiments_validate():
    rows = pipeline.run(timing_on=False)
    bad = [(r.shape, r.impl, r.status, r.note) for r in rows if r.status != "ok"]
    assert not bad, bad


@pytest.mark.gpu
@BLOG_SHAPES_NEED_A_GPU
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("b, M, start_pos", [(1, 1, 500), (1, 16, 0), (3, 37, 4000)],
                         ids=["token", "prompt", "odd-batch-M"])
def test_gpu_fused_blog_shape(dtype, b, M, start_pos):
    from ports import kernl

    x, w, rms_w = _inputs(b, M, 32, 128, 4096, DTYPES[dtype], device="cuda")
    with _alloc.poisoned():
        out = kernl.rms_matmul_rbe_wrapper(x, w, rms_w, True, start_pos, 32, 128)
    ref = pipeline.reference_pipeline(x, rms_w, w, start_pos, 32, 128)
    assert _err(out, ref) < pipeline.PIPELINE_TOL
    q, k, v = kernl.rms_matmul_rbe_qkv_wrapper(x, start_pos, w, w, w, rms_w, 32, 128)
    assert _err(q, ref) < pipeline.PIPELINE_TOL and _err(k, ref) < pipeline.PIPELINE_TOL
    plain = pipeline.reference_pipeline(x, rms_w, w, start_pos, 32, 128, use_rbe=False)
    assert _err(v, plain) < pipeline.PIPELINE_TOL


@pytest.mark.gpu
@BLOG_SHAPES_NEED_A_GPU
def test_gpu_rmsnorm_blog_shape():
    from ports import kernl

    x, _, rms_w = _inputs(1, 16, 32, 128, 4096, torch.float16, device="cuda")
    with _alloc.poisoned():
        out = kernl.rmsnorm_triton_wrapper(x, rms_w)
    assert _err(out, pipeline.reference_rmsnorm(x, rms_w)) < pipeline.ELEMENTWISE_TOL


@pytest.mark.gpu
@BLOG_SHAPES_NEED_A_GPU
def test_gpu_fused_does_not_recompile_for_a_new_length_or_position():
    from ports import _triton, kernl

    def call(M, pos):
        x, w, rms_w = _inputs(1, M, 32, 128, 4096, torch.float16, device="cuda")
        kernl.rms_matmul_rbe_wrapper(x, w, rms_w, True, pos, 32, 128)

    # Triton specialises ints equal to 1 or divisible by 16: stay clear of both
    call(23, 900)
    before = _triton.compiled_count(kernl.rms_matmul_rbe)
    call(61, 17)
    call(37, 5)
    assert _triton.compiled_count(kernl.rms_matmul_rbe) == before


@pytest.mark.gpu
@BLOG_SHAPES_NEED_A_GPU
def test_gpu_pipeline_mode_prints_timed_tables(capsys):
    assert cli.main(["--pipeline", "rbe"]) == 0
    text = capsys.readouterr().out
    assert "no GPU" not in text and "triton rbe_triton" in text
