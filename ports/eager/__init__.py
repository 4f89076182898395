"""Eager PyTorch baselines (their code lives in :mod:`reference.eager`) and torch.compile."""
