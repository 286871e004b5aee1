"""pyruntime.kernels: the Triton GPU kernels, kept in the repository's top-level kernels/ folder.

A wheel installs that folder here (pyproject.toml maps it to pyruntime/kernels); in a source
checkout (the editable install) this package's search path points at the folder itself. Nothing
here imports triton: a module of the folder does when it is imported, so a CPU-only install that
never touches the GPU path imports no Triton module. The folder has no __init__.py of its own, so
it is never a top-level package named `kernels` (that name is Hugging Face's kernels package).
"""

from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
# A source checkout is recognised by its C core header (an installed wheel's parent folder is
# site-packages, where a `kernels` folder would be someone else's package).
if (_REPO / "runtime" / "include" / "pyrt.h").is_file():
    __path__.append(str(_REPO / "kernels"))
