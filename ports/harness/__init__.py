"""The harness: validate every implementation against the float64 oracle, then time it.

* :mod:`~ports.harness.cli` parses ``compare.py``'s arguments (without importing torch) and
  dispatches to :mod:`~ports.harness.modes`, one function per mode;
* :mod:`~ports.harness.runner` validates and times one case against a list of specs
  (tests call :func:`~ports.harness.runner.run_case` directly);
* :mod:`~ports.harness.metrics` derives GB/s, % of copy and the ratios, in one place;
* :mod:`~ports.harness.report` writes tables, CSV, JSON and the bandwidth plot
  (:mod:`~ports.harness.plotstyle`: one line style per implementation in every panel);
* :mod:`~ports.harness.suites` and :mod:`~ports.harness.seed_suites` name the case lists;
* :mod:`~ports.harness.accuracy`, :mod:`~ports.harness.claims` and
  :mod:`~ports.harness.overhead` are the ``--accuracy``, ``--claims`` and ``--overhead`` modes;
* :mod:`~ports.harness.timing` and :mod:`~ports.harness.env` time on and describe the machine.

Seed 004's fused RMSNorm + matmul + RoPE experiments are not RoPE cases: they live in
``tools/seed004_pipeline.py`` (``--claims`` reads them from there).
"""
