#!/usr/bin/env python3
"""Cross-validate every RoPE implementation against a float64 reference and time them.

A thin wrapper: the logic lives in ``ports.harness`` (``python compare.py --help``).
"""
import sys

from ports.harness.cli import main

if __name__ == "__main__":
    sys.exit(main())
