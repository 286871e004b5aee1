"""Keep the libraries' objects out of Python's full garbage collections.

A full collection of the cyclic garbage collector walks every tracked object: ~180,000 once torch
and triton are imported, 120-150 ms a collection on a 2-core box, and one such collection took
65-137 ms inside a 64-token hybrid decode on the GPU host (a pause in one token, 1-2 ms a token
on average). `freeze_imports` moves the objects alive now into the collector's permanent
generation (gc.freeze), which collections skip, whenever modules were imported since it last
did. A Model calls it before it loads its weights, so a model's own objects stay collectable
(a dropped Model is freed, cycles included); what it freezes is mostly module-level state that
lives as long as the process anyway. At exit the frozen objects are handed back to the
collector (gc.unfreeze), so the interpreter's last collections free them as before (else
triton's nanobind reports its objects as leaked).
"""

from __future__ import annotations

import atexit
import gc
import sys

_modules_at_freeze = 0  # len(sys.modules) when freeze_imports last froze


def freeze_imports() -> bool:
    """Freeze the objects alive now if modules were imported since the last freeze (a collection
    first, so no garbage is frozen); returns whether it froze."""
    global _modules_at_freeze
    if len(sys.modules) == _modules_at_freeze:
        return False
    gc.collect()
    if not gc.get_freeze_count():
        atexit.register(gc.unfreeze)
    gc.freeze()
    _modules_at_freeze = len(sys.modules)
    return True
