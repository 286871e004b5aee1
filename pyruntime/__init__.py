"""pyruntime: run big Mixture-of-Experts language models on small machines, from GGUF files.

import pyruntime
model = pyruntime.Model("model.gguf")
for piece in model.generate("Once upon a time", max_tokens=32):
    print(piece, end="")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Model", "PyruntimeError", "__version__"]

if TYPE_CHECKING:
    from pyruntime.api import Model
    from pyruntime.errors import PyruntimeError


def __getattr__(name: str) -> Any:
    # Lazy: `import pyruntime` stays cheap (no torch import) for the CLI's --help and errors.
    if name == "Model":
        from pyruntime.api import Model

        return Model
    if name == "PyruntimeError":
        from pyruntime.errors import PyruntimeError

        return PyruntimeError
    raise AttributeError(f"module 'pyruntime' has no attribute {name!r}")
