"""The eager PyTorch baselines the seeds compare against, and ``torch.compile`` of HF's form.

Their code lives in :mod:`reference.eager`: the tests and the harness use these functions as
references, and ``reference`` imports nothing from ``ports``. This package re-exports them as the
family's API; :mod:`ports.eager.canonical` registers the rows (``torch.*``).

Upstreams (each function written as its original writes it):

* :func:`hf_apply_rotary_pos_emb`, :func:`hf_rotate_half`: Hugging Face
  ``huggingface/transformers:src/transformers/models/llama/modeling_llama.py``
  (``apply_rotary_pos_emb``, ``rotate_half``); rotate-half convention. ``torch.compile`` of it,
  with ``dynamic=False``, is the compiled row.
* :func:`llama_apply_rotary_emb`, :func:`precompute_freqs_cis`, :func:`reshape_for_broadcast`:
  Meta-Llama ``meta-llama/llama:llama/model.py`` (``apply_rotary_emb``, complex form), as seed
  document 004 quotes it; interleaved.
* :func:`llama_apply_rotary_emb_real`, :func:`precompute_freqs_cis_pytorch`: kernl's rewrite
  without complex numbers, ``ELS-RD/kernl@da9db806:experimental/llama-v2``
  (``apply_rotary_emb_pytorch``), as seed document 004 quotes it; interleaved.
* :class:`RotaryPositionalEmbeddings`: torchtune
  ``pytorch/torchtune:torchtune/modules/position_embeddings.py``, as seed document 003 quotes it;
  interleaved, fp32 cache, optional ``input_pos``.
* :func:`leetcuda_naive_rope`: ``xlite-dev/LeetCUDA@cb6a0497:kernels/rope/rope.py``
  (``naive_rope``, the torch row of seed document 001's table); interleaved.

Departures (none touches the arithmetic):

* Meta's ``llama_apply_rotary_emb`` accepts ``xk=None``, so one tensor can be timed alone.
* Upstream asserts become ``ValueError`` (``reshape_for_broadcast``'s shape check, kernl's even
  ``dim``).
* Tables are built on the caller's device, so every baseline also runs on the CPU: kernl's
  ``precompute_freqs_cis_pytorch`` takes ``device`` (upstream: ``device="cuda"``);
  ``leetcuda_naive_rope`` copies its CPU-built table with ``.to(x.device)`` (upstream:
  ``.cuda()``).
"""
from reference.eager import (
    RotaryPositionalEmbeddings,
    hf_apply_rotary_pos_emb,
    hf_rotate_half,
    leetcuda_naive_rope,
    llama_apply_rotary_emb,
    llama_apply_rotary_emb_real,
    precompute_freqs_cis,
    precompute_freqs_cis_pytorch,
    reshape_for_broadcast,
)

__all__ = ["hf_apply_rotary_pos_emb", "hf_rotate_half", "llama_apply_rotary_emb",
           "precompute_freqs_cis", "reshape_for_broadcast", "llama_apply_rotary_emb_real",
           "precompute_freqs_cis_pytorch", "RotaryPositionalEmbeddings", "leetcuda_naive_rope"]
