"""How many threads the C core runs: the physical cores by default, a request checked against
the machine.

Threads beyond the logical CPUs this process may run on can never all run at once: they only
take turns, and every hand-off between them waits for a descheduled thread (issue 20 measured
-t 1000 taking 9 s for a 9-token prompt). So a request above the logical CPUs is capped to them,
and one above the physical cores (SMT siblings share a core's arithmetic units, which the
kernels saturate) is allowed with a warning: one line each, on stderr in the CLI.
"""

from __future__ import annotations

import warnings

from pyruntime.cpu import core as cpu_core
from pyruntime.errors import PyruntimeWarning


def resolve_threads(requested: int | None) -> int:
    """The thread count for `requested` (None: the physical cores this process may use)."""
    physical = cpu_core.physical_cores()
    if requested is None:
        return physical
    logical = cpu_core.logical_cpus()
    if requested > logical:
        warnings.warn(
            f"{requested} threads asked for, but this process may run on {logical} CPUs: using "
            f"{logical} threads (more could only take turns on them)",
            PyruntimeWarning,
            stacklevel=2,
        )
        return logical
    if requested > physical:
        warnings.warn(
            f"{requested} threads asked for, more than the {physical} physical cores: threads "
            f"will share cores, which is usually slower than {physical}",
            PyruntimeWarning,
            stacklevel=2,
        )
    return requested
