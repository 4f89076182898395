"""Deprecated: ``ports.study`` is the earlier import path of ``ports.fastrope``; import that.

Importing it warns once (DeprecationWarning, at the first import; Python caches the module).
"""
import warnings

from ports.fastrope import MODULE, apply_rope, apply_rope_inplace

warnings.warn("ports.study is deprecated: import ports.fastrope (the same kernel)",
              DeprecationWarning, stacklevel=2)

__all__ = ["MODULE", "apply_rope", "apply_rope_inplace"]
