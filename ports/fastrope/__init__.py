"""fastrope, the package's own RoPE kernel: one CuPy RawKernel (rope.cu) launched once for q and k.

API::

    apply_rope(q, k=None, *, cos=None, sin=None, positions=None, offsets=None,
               cu_seqlens=None, max_seqlen=None, style="rotate_half", layout="bshd",
               rotary_dim=None, base=10000.0, inv_freq=None, check_positions=True)
    apply_rope_inplace(q, k=None, **same)
    qk_norm_rope(q, k, q_weight, k_weight, eps, *, cos=None, sin=None, positions=None,
                 style="rotate_half", layout="bshd", rotary_dim=None, base=10000.0, gemma=False)
    qk_norm_rope_inplace(q, k, q_weight, k_weight, eps, **same)

Both are autograd-aware from any thread (the backward is the same kernel rotating by -theta),
traced whole by ``torch.compile(fullgraph=True)`` and captured by CUDA graphs. ``apply_rope``
returns new contiguous tensors (q's rotated, or ``(q, k)``); ``apply_rope_inplace`` rotates q
(and k) in place and returns them. ``MODULE`` is rope.cu as a ``ports._cupy.CudaModule``.

The modules, in call order: api.py (the public functions), ops.py (the same as the custom ops
``torch.ops.fastrope.rope``, ``rope_`` and ``rope_out``, for torch.compile and tracing; replay.py
builds replay.cpp, their C++ kernels on CUDA tensors), run.py (one call end
to end, and its autograd), problem.py (the host checks), plan.py (the launch plan: a table of
named rules), launcher.py (the packed launch), kernel.py (rope.cu's instantiations), limits.py
(what validation and planning share); hf.py is a drop-in for Hugging Face transformers'
``apply_rotary_pos_emb`` (hf_kernels.py: the same through the ``kernels`` package's mapping;
hf_models.py: a small random model of each family; hf_qknorm.py: Qwen3's and Gemma3's q/k norm
and rotation as one qk_norm_rope), qknorm.py the fused per-head RMSNorm
+ RoPE, forward and backward (Triton kernels in qknorm_kernels.py, timed by
the harness's qknorm_bench.py), ablation.py runs the kernel with one idea switched off,
experiment.py is the documented interface the probes under tools/ use (kernel variants as build
options, fixed plans), canonical.py holds the registry entries, context_parallel.py splits
sequences across ranks (contiguous or zigzag shards, each with its tokens' positions). DESIGN.md
describes the kernel, its plan's rules and the measurement behind each.
"""
from __future__ import annotations

from ports.fastrope.api import apply_rope, apply_rope_inplace
from ports.fastrope.kernel import MODULE
from ports.fastrope.qknorm import qk_norm_rope, qk_norm_rope_inplace

__all__ = ["MODULE", "apply_rope", "apply_rope_inplace", "qk_norm_rope", "qk_norm_rope_inplace"]
