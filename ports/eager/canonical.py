"""Registry entries for the seeds' eager PyTorch baselines and for torch.compile.

Each adapter calls the original's own function with the original's own table source:
HF takes cos/sin tables gathered by position (cast to x's dtype, as HF's rotary module returns
them); Meta-Llama, kernl's rewrite and torchtune build their own fp32 tables from ``base``.
Gathering and casting tables happens in ``prepare``, outside the timed call: the rows time the
rotation, as the kernels' rows do (their tables are given too).
"""
from __future__ import annotations

import torch

from ports._adapters import forward_or_backward, per_tensor
from ports._spec import ALL_LAYOUTS, ALL_POSITIONS, FLOAT_DTYPES, ImplSpec
from reference import eager
from reference.case import RopeCase, RopeInputs
from reference.tolerances import ANGLE_REL_ERR_FP32, DEFAULT_STEPS
from reference.vocabulary import DTYPES, HEAD_AXIS

HF = "huggingface/transformers:src/transformers/models/llama/modeling_llama.py (rotate_half)"
META = "meta-llama/llama:llama/model.py (apply_rotary_emb, complex) via seed 004"
KERNL = "ELS-RD/kernl:experimental/llama-v2 (apply_rotary_emb_pytorch) via seed 004"
TORCHTUNE = "pytorch/torchtune:torchtune/modules/position_embeddings.py via seed 003 §3"
LEETCUDA_TORCH = "xlite-dev/LeetCUDA@cb6a0497:kernels/rope/rope.py (naive_rope)"

EAGER_DTYPES = frozenset(DTYPES)
FP32_MATH_DTYPES = FLOAT_DTYPES  # they compute in x.float(): no fp64

# HF rounds cos/sin to x's dtype and rounds after each op: a table rounding (0.5 step), two
# products and an add (0.5 step each) -> up to ~2 steps; 3 leaves margin.
HF_STEPS = dict(DEFAULT_STEPS, fp16=3.0, bf16=3.0)

# ---- Hugging Face rotate_half -----------------------------------------------------------------
def _hf_rows(case: RopeCase, inputs: RopeInputs, dtype: torch.dtype):
    """HF's cos/sin: rows gathered by position, ``[B, S, R]`` (``[S, B, R]`` for sbhd, ``[T, R]``
    for thd), in ``dtype``; HF's ``unsqueeze_dim`` then adds the layout's head axis."""
    cos, sin = inputs.cos[inputs.positions], inputs.sin[inputs.positions]  # [B, S, R] or [T, R]
    if case.layout == "sbhd":
        cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)
    return cos.to(dtype), sin.to(dtype)


def _hf_forward(case: RopeCase, inputs: RopeInputs, apply=eager.hf_apply_rotary_pos_emb):
    cos, sin = _hf_rows(case, inputs, case.torch_dtype)
    rot, dim = case.rot_dim, HEAD_AXIS[case.layout]

    def one(x):
        if rot == case.head_dim:
            return apply(x, None, cos, sin, dim)[0]
        # Partial rotary as HF's NeoX/Phi models do it: rotate a slice, concatenate the rest.
        return torch.cat([apply(x[..., :rot], None, cos, sin, dim)[0], x[..., rot:]], dim=-1)

    return per_tensor(one)


def _prepare_hf(case: RopeCase, inputs: RopeInputs):
    return forward_or_backward(case, inputs, _hf_forward(case, inputs))


def _compiled_apply():
    import torch._dynamo

    # Every suite shape compiles its own graph; the default limit (8) would silently fall back
    # to eager after eight shapes.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    if not hasattr(_compiled_apply, "fn"):
        _compiled_apply.fn = torch.compile(eager.hf_apply_rotary_pos_emb, dynamic=False)
    return _compiled_apply.fn


def _prepare_compiled(case: RopeCase, inputs: RopeInputs):
    return forward_or_backward(case, inputs, _hf_forward(case, inputs, _compiled_apply()))


# ---- Meta-Llama complex, and kernl's real rewrite --------------------------------------------
def _prepare_llama_complex(case: RopeCase, inputs: RopeInputs):
    freqs_cis = eager.precompute_freqs_cis(case.head_dim, case.seqlen, theta=case.base)
    freqs_cis = freqs_cis.to(inputs.x.device)

    def forward(xs):
        q, k = xs[0], (xs[1] if len(xs) > 1 else None)
        outs = eager.llama_apply_rotary_emb(q, k, freqs_cis)
        return outs[: len(xs)]

    return forward_or_backward(case, inputs, forward)


def _prepare_llama_real(case: RopeCase, inputs: RopeInputs):
    cos, sin = eager.precompute_freqs_cis_pytorch(case.head_dim, case.seqlen, theta=case.base,
                                                  device=inputs.x.device)
    fwd = per_tensor(lambda x: eager.llama_apply_rotary_emb_real(x, cos, sin))
    return forward_or_backward(case, inputs, fwd)


# ---- torchtune -------------------------------------------------------------------------------
def _torchtune_check(case: RopeCase) -> str | None:
    if case.positions != "arange" and case.batch != 1:
        return "input_pos is one [s] vector shared by the whole batch: needs b == 1"
    return None


def _prepare_torchtune(case: RopeCase, inputs: RopeInputs):
    module = eager.RotaryPositionalEmbeddings(case.head_dim, max_seq_len=case.table_rows,
                                              base=case.base).to(inputs.x.device)
    input_pos = None if case.positions == "arange" else inputs.positions[0]
    fwd = per_tensor(lambda x: module(x, input_pos=input_pos))
    return forward_or_backward(case, inputs, fwd)


# ---- LeetCUDA's naive_rope (seed 001's torch row) -------------------------------------------
def _one_sequence_one_head(case: RopeCase) -> str | None:
    if case.batch != 1 or case.heads != 1 or case.kv_heads is not None:
        return "one sequence of one head only (x[S, D]: b = h = 1)"
    return None


def _prepare_leetcuda_naive(case: RopeCase, inputs: RopeInputs):
    shape = inputs.x.shape
    fwd = per_tensor(lambda x: eager.leetcuda_naive_rope(x.reshape(case.seqlen, case.head_dim),
                                                         theta=case.base).view(shape))
    return forward_or_backward(case, inputs, fwd)


_COMMON = dict(backend="torch", kind="baseline", tensors_per_launch=0, backward=True)

SPECS = [
    ImplSpec(name="torch.hf_rotate_half",
             launch='eager: ~6 kernels', per_thread='-', access='torch elementwise',
             math="x's dtype, table rounded to x's dtype", family="eager", upstream=HF,
             summary="eager q*cos + rotate_half(q)*sin, tables in x's dtype",
             prepare=_prepare_hf, styles=frozenset({"rotate_half"}), layouts=ALL_LAYOUTS,
             dtypes=EAGER_DTYPES, partial=True, positions=ALL_POSITIONS,
             devices=frozenset({"cpu", "cuda"}), asymmetric_tables=True,
             tolerance_steps=HF_STEPS, baseline=True, **_COMMON),
    ImplSpec(name="torch.compile(hf_rotate_half)",
             launch='inductor: 1 fused Triton kernel', per_thread="inductor's choice",
             access='inductor-vectorized', math="x's dtype upcast to fp32 inside the fused kernel",
             family="eager", upstream=HF,
             summary="torch.compile(dynamic=False) of the HF function",
             prepare=_prepare_compiled, styles=frozenset({"rotate_half"}), layouts=ALL_LAYOUTS,
             dtypes=EAGER_DTYPES, partial=True, positions=ALL_POSITIONS,
             asymmetric_tables=True, tolerance_steps=HF_STEPS, compile_reference=True,
             **_COMMON),
    ImplSpec(name="torch.llama_complex",
             launch='eager: complex multiply', per_thread='-', access='torch elementwise',
             math='fp32 (x.float()), fp32 table from base', family="eager", upstream=META,
             summary="view_as_complex(x.float()) * freqs_cis (fp32 table from base)",
             prepare=_prepare_llama_complex, styles=frozenset({"interleaved"}),
             layouts=frozenset({"bshd"}), dtypes=FP32_MATH_DTYPES, partial=False,
             positions=frozenset({"arange"}), devices=frozenset({"cpu", "cuda"}),
             table_source="computed", angle_rel_err=ANGLE_REL_ERR_FP32, baseline=True,
             **_COMMON),
    ImplSpec(name="torch.llama_real",
             launch='eager: ~8 kernels', per_thread='-', access='torch elementwise',
             math='fp32, fp32 table from base', family="eager", upstream=KERNL,
             summary="x[...,0::2], x[...,1::2] real arithmetic (fp32 table from base)",
             prepare=_prepare_llama_real, styles=frozenset({"interleaved"}),
             layouts=frozenset({"bshd"}), dtypes=FP32_MATH_DTYPES, partial=False,
             positions=frozenset({"arange"}), devices=frozenset({"cpu", "cuda"}),
             table_source="computed", angle_rel_err=ANGLE_REL_ERR_FP32, **_COMMON),
    ImplSpec(name="torch.torchtune",
             launch='eager: ~8 kernels', per_thread='-', access='torch elementwise',
             math='fp32, fp32 cache from base', family="eager", upstream=TORCHTUNE,
             summary="nn.Module with cached fp32 table, optional input_pos",
             prepare=_prepare_torchtune, styles=frozenset({"interleaved"}),
             layouts=frozenset({"bshd"}), dtypes=FP32_MATH_DTYPES, partial=False,
             positions=ALL_POSITIONS, devices=frozenset({"cpu", "cuda"}),
             table_source="computed", angle_rel_err=ANGLE_REL_ERR_FP32,
             check=_torchtune_check, **_COMMON),
    ImplSpec(name="torch.leetcuda_naive",
             launch='eager + CPU table + H2D copy per call', per_thread='-',
             access='torch elementwise', math='fp32, table built on the CPU', family="eager",
             upstream=LEETCUDA_TORCH,
             summary="complex form, fp32 table built on the CPU and copied in every call",
             prepare=_prepare_leetcuda_naive, styles=frozenset({"interleaved"}),
             layouts=frozenset({"bshd", "sbhd", "bhsd"}), dtypes=frozenset({"fp32"}),
             partial=False, positions=frozenset({"arange"}), devices=frozenset({"cpu", "cuda"}),
             table_source="computed", angle_rel_err=ANGLE_REL_ERR_FP32,
             check=_one_sequence_one_head, **_COMMON),
]
