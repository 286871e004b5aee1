"""User-facing errors.

Every error a user can cause (bad file, bad flag, unknown architecture, budget too small) is
raised as a `PyruntimeError` subclass whose message is one line saying what was wrong, where, and
what to do. The CLI prints that line and exits non-zero without a traceback; anything else is a bug.
"""


class PyruntimeError(Exception):
    """Base class of errors caused by user input rather than by a bug."""


class ModelFileError(PyruntimeError):
    """A model file is missing, truncated, not GGUF, or lacks a tensor/key we need."""


class ConversionError(PyruntimeError):
    """A Hugging Face checkpoint cannot be converted (unknown architecture, bad config, tensors)."""


class UsageError(PyruntimeError):
    """A flag or argument value is invalid."""


class PyruntimeWarning(UserWarning):
    """Something a user should know that does not stop the run (an unwritable cache folder, a
    prompt past the model's trained context, input bytes that were not UTF-8). The CLI prints
    each as one `warning: ` line on stderr."""


class DeviceMemoryError(PyruntimeError):
    """The GPU memory budget cannot hold what it must (the dense weights and the KV cache), or
    the GPU ran out of memory while loading or running; the message says how much was needed."""
