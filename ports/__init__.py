"""The RoPE implementations the study compares, with the helpers they share.

* Ports, one sub-package per upstream family, each with an API that mirrors its original and can
  be imported on its own (``from ports.leetcuda import rope_f32``): ``apex``, ``paddle``,
  ``oneflow``, ``leetcuda`` (CuPy), ``te_triton``, ``batch_reuse``, ``kernl`` (Triton), and
  ``eager`` (the seeds' PyTorch baselines and ``torch.compile``; code in :mod:`reference.eager`).
  A family's ``__init__`` names its upstream and its departures; its ``canonical`` module holds
  the registry rows (:class:`ports._spec.ImplSpec`).
* ``fastrope``: the package's own kernel, the one folder here that is not a port.
* ``registry`` lists every implementation with what it supports; ``harness`` cross-validates and
  times them (``compare.py`` is its command line).
* Shared helpers: ``_spec`` (the row record), ``_cupy`` and ``_triton`` (host checks, compile and
  launch), ``_alloc`` (outputs that can be poisoned with NaN), ``_adapters`` (forward and
  backward calls for the rows). The vocabulary (styles, layouts, dtypes) is
  :mod:`reference.vocabulary`.
"""
