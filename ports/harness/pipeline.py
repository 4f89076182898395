"""Seed 004's experiments under their earlier import path: they live in
``tools/seed004_pipeline.py`` (not a compare.py suite: the fused kernel includes the matmul)."""
from tools.seed004_pipeline import *
from tools.seed004_pipeline import main as main_pipeline  # noqa: F401
