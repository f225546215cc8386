"""Registry of GGUF tensor formats, one small module each, over the format table (``table``)."""
from __future__ import annotations

import importlib

from .base import QuantFormat
from .table import SPECS, WEIGHT_FORMATS, FormatSpec

FORMATS: dict[str, QuantFormat] = {}
for _name in WEIGHT_FORMATS:  # the format table's order
    _fmt = importlib.import_module(f"{__name__}.{_name.lower()}").FORMAT
    FORMATS[_fmt.name] = _fmt

BY_GGML_TYPE: dict[int, QuantFormat] = {f.ggml_type: f for f in FORMATS.values() if f.ggml_type is not None}


def get_format(key: str | int) -> QuantFormat:
    """A format by name ("Q4_K", case-insensitive) or by GGML type number."""
    if isinstance(key, str):
        fmt = FORMATS.get(key.upper())
    else:
        fmt = BY_GGML_TYPE.get(int(key))
    if fmt is None:
        known = ", ".join(FORMATS)
        raise ValueError(f"unsupported tensor format {key!r}; supported: {known}")
    return fmt


__all__ = ["QuantFormat", "FormatSpec", "FORMATS", "SPECS", "BY_GGML_TYPE", "get_format"]
