"""Errors a user can act on. Surfaces print their message without a traceback."""
import math


class WorkbenchError(Exception):
    """Base class: bad input or an unsupported request, with a message that names the problem."""


class ModelLoadError(WorkbenchError):
    """A model file or checkpoint is missing, corrupt, truncated or of an unsupported kind."""


class HookError(WorkbenchError, ValueError):
    """An unknown hook point, or an intervention that does not fit the activation it targets."""


class QuantizeError(WorkbenchError, ValueError):
    """A quantization to load into that is neither a known format nor a known mix."""



def finite_number(value: object, what: str, error: type[WorkbenchError] = WorkbenchError) -> float:
    """``value`` as a finite float, or ``error`` naming ``what`` (a scale, a clamp value, ... a user gave)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise error(f"{what} must be a number, got {shorten(value)}") from None
    if not math.isfinite(number):
        raise error(f"{what} must be finite, got {shorten(value)}")
    return number


def shorten(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for echoing user input in an error message (a 1 MB hook
    name must not make a 1 MB error)."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value):,} characters)"
    if isinstance(value, (list, tuple, dict)) and len(value) > limit:
        return f"<{type(value).__name__} of {len(value):,} items>"
    return clip(repr(value), limit)


def clip(message: str, limit: int) -> str:
    """A message cut to ``limit`` characters (an error that quotes a long input, passed on to a client)."""
    return message if len(message) <= limit else message[:limit] + "..."
