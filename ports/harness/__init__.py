"""The harness: validate every implementation against the float64 oracle, then time it.

* :mod:`~ports.harness.cli` parses ``compare.py``'s arguments (without importing torch) and
  dispatches to :mod:`~ports.harness.modes`, one function per mode;
  :mod:`~ports.harness.cases` builds the cases of a ``--shape``/``--suite`` run;
* :mod:`~ports.harness.runner` validates and times one case against a list of specs
  (tests call :func:`~ports.harness.runner.run_case` directly) into the records of
  :mod:`~ports.harness.result`;
* :mod:`~ports.harness.metrics` derives GB/s, % of copy and the ratios, in one place;
* :mod:`~ports.harness.report` writes tables, CSV, JSON and the bandwidth plot
  (:mod:`~ports.harness.plotstyle`: one line style per implementation in every panel);
* :mod:`~ports.harness.suites` and :mod:`~ports.harness.seed_suites` name the case lists;
* :mod:`~ports.harness.accuracy`, :mod:`~ports.harness.claims`, :mod:`~ports.harness.pipeline`
  and :mod:`~ports.harness.overhead` are the ``--accuracy``, ``--claims``, ``--pipeline`` and
  ``--overhead`` modes (the pipeline: seed 004's fused RMSNorm + matmul + RoPE experiments, which
  are not RoPE cases);
* :mod:`~ports.harness.timing` and :mod:`~ports.harness.env` time on and describe the machine.

Imports point down: cli -> modes -> (cases, runner, report, the mode modules) -> runner ->
(metrics, timing) -> result.
"""
