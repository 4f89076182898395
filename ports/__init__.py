"""Ports of the RoPE kernels that the big frameworks ship, one sub-package per upstream family.

Each family can be imported on its own (``from ports.leetcuda import rope_f32``) with an API that
mirrors its original. ``ports.registry`` lists every implementation with what it supports, and
``ports.harness`` cross-validates and times them (``compare.py`` is its command line).
"""
