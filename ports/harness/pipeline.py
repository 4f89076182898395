"""Seed 004's experiments: RoPE fused into the QKV projection, and its two standalone parts.

kernl's blog (seed 004) times three things on Llama-2-7B shapes (hidden 4096 = 32 heads x 128,
fp16, batch 1): its RBE kernel against PyTorch, its RMSNorm kernel against PyTorch, and the fused
``rms_matmul_rbe`` (RMSNorm + projection + RoPE) against the unfused PyTorch pipeline. None of these
is a canonical RoPE case (the fused kernel does a matmul), so they are not registry rows and no
``--suite`` runs them: :func:`run` validates each against a float64 reference and times it on a
GPU. ``compare.py --pipeline`` prints its tables and ``compare.py --claims`` reads it for seed
004's claims::

    python compare.py --pipeline [rbe rmsnorm fused] [--seed N]

Pipelines compared (all produce ``[batch, M, heads, head_dim]`` in x's dtype):

* ``torch``: kernl's ``rms_norm_pytorch``, ``x_norm @ W.T``, kernl's ``apply_rotary_emb_pytorch``
  with cos/sin tables precomputed (``precompute_freqs_cis_pytorch``) outside the timed call;
* ``torch+rbe_triton``: the same, with kernl's standalone ``rbe_triton`` as the RoPE (the best
  standalone interleaved RoPE with angles at ``start_pos + m`` among the ports);
* ``triton unfused``: ``rmsnorm_triton``, torch matmul, ``rbe_triton`` (upstream's unfused chain);
* ``fused rms_matmul_rbe``: one kernel.

The reference is float64 end to end: ``rmsnorm(x) @ W.T`` then the interleaved rotation with
angles ``(start_pos + m) * theta ** (-2i / head_dim)``. A pipeline passes when the normwise relative
error ``||out - ref|| / ||ref||`` is below ``PIPELINE_TOL`` (fp16 inputs, fp16 matmul output);
the standalone RMSNorm and RBE, a single rounding to fp16 each, must be below ``ELEMENTWISE_TOL``.

It lives in the harness, not in ``ports/kernl``, because it times: a port never imports the
harness.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

PIPELINE_TOL = 1e-2      # fp16 matmul over K = 4096, rounded (as upstream) between its stages
ELEMENTWISE_TOL = 2e-3   # one fp16 rounding (2^-11 relative) and fp32 arithmetic, with margin
EPS = 1e-6
THETA = 10000.0


# ---- the blog's PyTorch counterparts ---------------------------------------------------------
def rms_norm_pytorch(x: torch.Tensor, rms_w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """kernl's ``rms_norm_pytorch`` (seed 004): six eager ops."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rms_w


def rope_tables(head_dim: int, start_pos: int, M: int, theta: float, device) -> tuple:
    """kernl's ``precompute_freqs_cis_pytorch`` rows ``start_pos .. start_pos + M - 1`` (fp32)."""
    from reference.eager import precompute_freqs_cis_pytorch

    cos, sin = precompute_freqs_cis_pytorch(head_dim, start_pos + M, theta, device=device)
    return cos[start_pos:].contiguous(), sin[start_pos:].contiguous()


# ---- float64 references ----------------------------------------------------------------------
def reference_rmsnorm(x: torch.Tensor, rms_w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    x = x.to(torch.float64)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * rms_w.to(torch.float64)


def reference_rbe(x: torch.Tensor, start_pos: int, head_dim: int, theta: float = THETA
                  ) -> torch.Tensor:
    """Interleaved RoPE of ``x [batch, M, heads * head_dim]`` in float64, positions from start_pos;
    returns ``[batch, M, heads, head_dim]``."""
    b, M, N = x.shape
    xd = x.to(torch.float64).view(b, M, N // head_dim, head_dim // 2, 2)
    i = torch.arange(0, head_dim, 2, dtype=torch.float64, device=x.device)
    inv = theta ** (-i / head_dim)
    pos = torch.arange(start_pos, start_pos + M, dtype=torch.float64, device=x.device)
    ang = pos[:, None] * inv[None, :]                   # [M, d/2]
    cos, sin = torch.cos(ang)[None, :, None], torch.sin(ang)[None, :, None]
    re, im = xd[..., 0], xd[..., 1]
    return torch.stack((re * cos - im * sin, re * sin + im * cos), -1).view(b, M, N // head_dim,
                                                                             head_dim)


def reference_pipeline(x, rms_w, weight, start_pos, heads, head_dim, use_rbe=True, eps=EPS,
                       theta=THETA) -> torch.Tensor:
    """float64 ``RBE(rmsnorm(x) @ weight.T)`` as ``[batch, M, heads, head_dim]``."""
    y = reference_rmsnorm(x, rms_w, eps) @ weight.to(torch.float64).t()
    if not use_rbe:
        return y.view(*y.shape[:2], heads, head_dim)
    return reference_rbe(y, start_pos, head_dim, theta)


def normwise_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (NaN if out has a NaN)."""
    diff = out.to(torch.float64).reshape(-1) - ref.reshape(-1)
    den = float(ref.norm())
    return float(diff.norm()) / den if den else float(diff.norm())


# ---- shapes and inputs -----------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """One experiment point: x ``[batch, M, heads * head_dim]``, tokens from ``start_pos``."""

    batch: int
    M: int
    start_pos: int
    heads: int = 32
    head_dim: int = 128
    dtype: torch.dtype = torch.float16
    label: str = field(default="", compare=False)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    def describe(self) -> str:
        return (f"{self.label + ': ' if self.label else ''}x [{self.batch}, {self.M}, {self.hidden}] "
                f"{str(self.dtype).replace('torch.', '')}, positions {self.start_pos}.."
                f"{self.start_pos + self.M - 1}")


def blog_shapes() -> list[Shape]:
    """Llama-2-7B (hidden 4096 = 32 x 128, fp16, batch 1), as upstream's benchmark script:
    a 16-token prompt at position 0, and one generated token (upstream checks position 5; here
    position 500, the blog's 500-token generation, so the rotation is far from the identity)."""
    return [Shape(1, 1, 500, label="seed004 single token"),
            Shape(1, 16, 0, label="seed004 short prompt")]


def tiny_shapes() -> list[Shape]:
    """A shape cheap enough for the Triton interpreter (validation only)."""
    return [Shape(2, 3, 7, heads=2, head_dim=32, label="tiny (interpreter)")]


def make_inputs(shape: Shape, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """x ~ N(0, 1); rms_w and W ~ 0.2 N(0, 1) as upstream's script (W is ``[N, K]``)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    K = N = shape.hidden

    def randn(*size, scale=1.0):
        return (torch.randn(size, generator=gen, device=device) * scale).to(shape.dtype)

    return {"x": randn(shape.batch, shape.M, K), "rms_w": randn(K, scale=0.2),
            "weight": randn(N, K, scale=0.2),
            "proj": randn(shape.batch, shape.M, N)}  # the RBE experiment's input (a projection)


# ---- what runs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Impl:
    experiment: str        # "rbe", "rmsnorm" or "fused"
    name: str
    build: Callable        # (shape, inputs) -> zero-arg callable returning the output
    reference: Callable    # (shape, inputs) -> float64 expected output
    tol: float
    baseline: bool = False


def _rbe_ref(s, t):
    return reference_rbe(t["proj"], s.start_pos, s.head_dim)


def _rms_ref(s, t):
    return reference_rmsnorm(t["x"], t["rms_w"])


def _pipe_ref(s, t):
    return reference_pipeline(t["x"], t["rms_w"], t["weight"], s.start_pos, s.heads, s.head_dim)


def _rbe_torch(s, t):
    from reference.eager import llama_apply_rotary_emb_real as apply_rotary_emb_pytorch

    cos, sin = rope_tables(s.head_dim, s.start_pos, s.M, THETA, t["proj"].device)
    x4 = t["proj"].view(s.batch, s.M, s.heads, s.head_dim)
    return lambda: apply_rotary_emb_pytorch(x4, cos, sin)


def _rbe_triton(s, t):
    from ports import kernl

    return lambda: kernl.rbe_triton_wrapper(t["proj"], s.start_pos, head_dim=s.head_dim).view(
        s.batch, s.M, s.heads, s.head_dim)


def _rms_torch(s, t):
    return lambda: rms_norm_pytorch(t["x"], t["rms_w"])


def _rms_triton(s, t):
    from ports import kernl

    return lambda: kernl.rmsnorm_triton_wrapper(t["x"], t["rms_w"])


def _pipe_torch(s, t):
    from reference.eager import llama_apply_rotary_emb_real as apply_rotary_emb_pytorch

    cos, sin = rope_tables(s.head_dim, s.start_pos, s.M, THETA, t["x"].device)
    x, rms_w, w = t["x"], t["rms_w"], t["weight"]

    def run():
        y = (rms_norm_pytorch(x, rms_w) @ w.t()).view(s.batch, s.M, s.heads, s.head_dim)
        return apply_rotary_emb_pytorch(y, cos, sin)
    return run


def _pipe_torch_rbe(s, t):
    from ports import kernl

    x, rms_w, w = t["x"], t["rms_w"], t["weight"]

    def run():
        y = rms_norm_pytorch(x, rms_w) @ w.t()
        return kernl.rbe_triton_wrapper(y, s.start_pos, head_dim=s.head_dim).view(
            s.batch, s.M, s.heads, s.head_dim)
    return run


def _pipe_triton_unfused(s, t):
    from ports import kernl

    x, rms_w, w = t["x"], t["rms_w"], t["weight"]

    def run():
        y = kernl.rmsnorm_triton_wrapper(x, rms_w) @ w.t()
        return kernl.rbe_triton_wrapper(y, s.start_pos, head_dim=s.head_dim).view(
            s.batch, s.M, s.heads, s.head_dim)
    return run


def _fused_blocks(s) -> dict:
    """Upstream's tiles; the tiny interpreter shape needs block_n <= head_dim and block_k | K."""
    from ports.kernl.fused import BLOCKS

    if s.hidden % BLOCKS["block_size_k"] == 0:
        return {}
    return {"block_size_n": 16, "block_size_k": 16}


def _pipe_fused(s, t):
    from ports import kernl

    blocks = _fused_blocks(s)
    return lambda: kernl.rms_matmul_rbe_wrapper(t["x"], t["weight"], t["rms_w"], True,
                                                s.start_pos, s.heads, s.head_dim, **blocks)


IMPLS: list[Impl] = [
    Impl("rbe", "torch apply_rotary_emb_pytorch", _rbe_torch, _rbe_ref, ELEMENTWISE_TOL, True),
    Impl("rbe", "triton rbe_triton", _rbe_triton, _rbe_ref, ELEMENTWISE_TOL),
    Impl("rmsnorm", "torch rms_norm_pytorch", _rms_torch, _rms_ref, ELEMENTWISE_TOL, True),
    Impl("rmsnorm", "triton rmsnorm_triton", _rms_triton, _rms_ref, ELEMENTWISE_TOL),
    Impl("fused", "torch rmsnorm + matmul + torch rope", _pipe_torch, _pipe_ref, PIPELINE_TOL,
         True),
    Impl("fused", "torch rmsnorm + matmul + rbe_triton", _pipe_torch_rbe, _pipe_ref,
         PIPELINE_TOL),
    Impl("fused", "rmsnorm_triton + matmul + rbe_triton", _pipe_triton_unfused, _pipe_ref,
         PIPELINE_TOL),
    Impl("fused", "fused rms_matmul_rbe (Triton)", _pipe_fused, _pipe_ref, PIPELINE_TOL),
]
EXPERIMENTS = ("rbe", "rmsnorm", "fused")
TITLES = {"rbe": "RBE (RoPE) vs PyTorch: x [batch, M, 4096] projection output",
          "rmsnorm": "RMSNorm vs PyTorch",
          "fused": "RMSNorm + Q projection + RoPE: fused rms_matmul_rbe vs unfused"}


@dataclass
class Row:
    experiment: str
    shape: str
    impl: str
    status: str            # ok, FAIL, error
    rel_err: float | None
    tol: float
    median_us: float | None = None
    speedup: float | None = None
    note: str = ""


def run(shapes: Sequence[Shape] | None = None, experiments: Sequence[str] = EXPERIMENTS, *,
        seed: int = 0, device=None, timing_on: bool | None = None) -> list[Row]:
    """Validate every implementation of ``experiments`` on ``shapes`` against float64, then (on a
    GPU, if it passed) time it with :func:`ports.harness.timing.median_us`."""
    from ports.harness import timing

    device = torch.device(device if device is not None else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    timing_on = device.type == "cuda" if timing_on is None else timing_on
    shapes = list(blog_shapes() if shapes is None else shapes)
    rows: list[Row] = []
    for shape in shapes:
        inputs = make_inputs(shape, seed, device)
        refs: dict[str, torch.Tensor] = {}
        for exp in experiments:
            base_us = None
            for impl in (i for i in IMPLS if i.experiment == exp):
                row = Row(exp, shape.describe(), impl.name, "ok", None, impl.tol)
                try:
                    if exp not in refs:
                        refs[exp] = impl.reference(shape, inputs)
                    fn = impl.build(shape, inputs)
                    out = fn()
                    row.rel_err = normwise_rel_err(out, refs[exp])
                    if out.shape != refs[exp].shape:
                        row.status, row.note = "FAIL", f"shape {tuple(out.shape)}"
                    elif not row.rel_err < impl.tol:
                        row.status, row.note = "FAIL", "error above tolerance"
                    elif timing_on:
                        row.median_us = timing.median_us(fn)
                    else:
                        row.note = "timing needs an NVIDIA GPU"
                except Exception as exc:  # one failing implementation never stops the others
                    row.status = "error"
                    row.note = f"{type(exc).__name__}: {str(exc).strip()[:120]}"
                if impl.baseline:
                    base_us = row.median_us
                if row.median_us and base_us:
                    row.speedup = base_us / row.median_us
                rows.append(row)
        del inputs, refs
    return rows


HEADERS = ("shape", "implementation", "check", "rel err", "tol", "median us", "vs torch")


def table_rows(rows: Sequence[Row], experiment: str) -> list[list[str]]:
    """Table cells for one experiment; cells without a number say why."""
    out = []
    for r in rows:
        if r.experiment != experiment:
            continue
        no_time = "no GPU" if r.status == "ok" else "not timed"
        out.append([r.shape, r.impl,
                    "ok" if r.status == "ok" else f"{r.status}: {r.note}",
                    "n/a" if r.rel_err is None else f"{r.rel_err:.2e}", f"{r.tol:g}",
                    no_time if r.median_us is None else f"{r.median_us:.1f}",
                    ("baseline n/a" if r.median_us is not None else no_time) if r.speedup is None
                    else f"{r.speedup:.2f}"])
    return out


def tables(rows: Sequence[Row], fmt: str = "github") -> str:
    """One table per experiment, each fitted to the harness's output width."""
    from ports.harness.report import text_table

    return "\n\n".join(f"## {TITLES[exp]}\n" + text_table(table_rows(rows, exp), HEADERS, fmt,
                                                           fit=True)
                       for exp in dict.fromkeys(r.experiment for r in rows))


NO_GPU_NOTE = ("No CUDA GPU found: seed 004's experiments are timed on a GPU only. Validating the "
               "kernels under TRITON_INTERPRET=1\non a tiny shape (hidden {hidden}) instead; the "
               "blog's Llama-2-7B shapes need a GPU.")
