"""The package's own kernel under its earlier import path: ``ports.study`` is ``ports.fastrope``."""
from ports.fastrope import MODULE, apply_rope, apply_rope_inplace

__all__ = ["MODULE", "apply_rope", "apply_rope_inplace"]
