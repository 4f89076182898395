"""The study harness: validate every implementation against the float64 oracle, then time it.

``compare.py`` is a thin command line over :mod:`ports.harness.cli`; tests call
:func:`ports.harness.runner.run_case` directly.
"""
