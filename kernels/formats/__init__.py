"""Registry of GGUF tensor formats, one small module each."""
from __future__ import annotations

import importlib

from .base import QuantFormat

_MODULES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")

FORMATS: dict[str, QuantFormat] = {}
for _name in _MODULES:
    _fmt = importlib.import_module(f"{__name__}.{_name}").FORMAT
    FORMATS[_fmt.name] = _fmt

BY_GGML_TYPE: dict[int, QuantFormat] = {f.ggml_type: f for f in FORMATS.values()}


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


__all__ = ["QuantFormat", "FORMATS", "BY_GGML_TYPE", "get_format"]
