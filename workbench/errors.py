"""Errors a user can act on. Surfaces print their message without a traceback."""
import math
import numbers
import operator
from typing import Any


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


def real_number(value: object, what: str, error: type[WorkbenchError] = WorkbenchError,
                finite: bool = True) -> float:
    """``value`` as a float when it is a real number (Python, numpy or 0-d torch), or ``error`` naming ``what``; a
    finite one unless ``finite`` is False (a temperature may be infinite, or NaN for its own check to refuse).
    Stricter than ``finite_number``: a string ("0.5") or a bool is refused, not converted."""
    item = value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value
    if isinstance(item, bool) or not isinstance(item, numbers.Real):
        raise error(f"{what} must be a number, got {shorten(value)}")
    return finite_number(item, what, error) if finite else float(item)


def integer(value: object, what: str, error: type[WorkbenchError] = WorkbenchError) -> int:
    """``value`` as an int when it is an integer (Python, numpy or 0-d torch), or ``error`` naming ``what``: a float
    such as 1.7 or 1.0 is refused, not floored, and a bool is refused."""
    try:
        if isinstance(value, bool) or type(value).__name__ == "bool_":
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise error(f"{what} must be an integer, got {shorten(value)}") from None


# The seeds torch's generators take (manual_seed raises past them).
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)


def seed(value: object, what: str = "seed", error: type[WorkbenchError] = WorkbenchError) -> int:
    """``value`` as an int in ``SEED_RANGE`` (see ``integer``), or ``error`` naming ``what``."""
    number = integer(value, what, error)
    if not SEED_RANGE[0] <= number <= SEED_RANGE[1]:
        raise error(f"{what} must be an integer in -2**63 .. 2**64 - 1, got {shorten(number)}")
    return number


def integer_list(values: Any, what: str, error: type[WorkbenchError] = WorkbenchError) -> list[int]:
    """``values`` as a list of ints (see ``integer``), or ``error``."""
    return _list_of(values, what, integer, "integers", error)


def number_list(values: Any, what: str, error: type[WorkbenchError] = WorkbenchError) -> list[float]:
    """``values`` as a list of finite floats (see ``real_number``), or ``error``."""
    return _list_of(values, what, real_number, "numbers", error)


def _list_of(values: Any, what: str, item: Any, noun: str, error: type[WorkbenchError]) -> list:
    """``[item(v, what) for v in values]``, or ``error``: a single string would otherwise be walked character by
    character, and a bare number is not a list."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise error(f"{what} must be a list of {noun}, got {shorten(values)}")
    values = list(values)
    try:
        return [item(v, what) for v in values]
    except WorkbenchError:
        raise error(f"{what} must be a list of {noun}, got {shorten(values)}") from None


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
