"""Fast CPU matmuls straight from GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4).

The work is done by a small C++ extension (``csrc/cpu_kernels.cpp``), compiled on first use with
``torch.utils.cpp_extension.load`` and cached in the torch extensions directory. It reads the packed
weights in place (resident weight memory is exactly the GGUF bytes), parallelizes over output
features with torch's OpenMP pool, and is built for the widest of AVX-512, AVX2/FMA or plain C++ that the
CPU runs (with AVX-512, the 4-bit formats' dot products look each weight up in a 16-float table).

Two numerics, chosen with :func:`set_numerics` or the :func:`numerics` context manager (the switch is
:mod:`workbench.kernels.linear`'s, re-exported here):

* ``"exact"`` (default): ``x @ dequantize(W).T`` up to fp32 rounding. Small batches dequantize each
  weight group in registers inside the dot product; from :data:`PANEL_MIN_BATCH` rows on, panels of
  ``W`` are dequantized into a ~1 MiB scratch buffer and multiplied by the BLAS.
* ``"llamacpp"``: as ggml-cpu computes it: activations quantized to the weight type's ``vec_dot_type``
  (Q8_0 for Q4_0/Q5_0/Q8_0/MXFP4, Q8_1 for Q4_1/Q5_1, Q8_K for K-quants), integer block dot products,
  block scales applied in fp32.

Without a working compiler the extension cannot be built: a warning says so once and matmuls take
the ``blockwise-dequant-matmul`` path of :mod:`workbench.kernels.linear`.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import launch_choices
from workbench.cache import cache_dir

from .formats.table import QUANTIZED_FORMATS, SPECS
from .linear import BLOCKWISE, Kernel, get_numerics, numerics, register_kernel, set_numerics
from .quant_tensor import QuantTensor

# GGML type number -> name, for the formats the extension implements: every quantized format of the format table.
SUPPORTED_TYPES: dict[int, str] = dict(sorted((SPECS[name].ggml_type, name) for name in QUANTIZED_FORMATS))

# Batch size from which exact matmuls dequantize panels of W for the BLAS instead of fusing the
# dequantization into the dot products (a launch choice, ``launch_choices``' ``cpu.panel_min_batch``).
PANEL_MIN_BATCH = launch_choices.PANEL_MIN_BATCH

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
_AVX512_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
_ISA_FLAGS = {
    # AMX's int8 tiles for batches of the formats with a scale a 32 (csrc: tile_matmul)
    "avx512_amx": [*_AVX512_FLAGS, "-mavx512vnni", "-mamx-tile", "-mamx-int8"],
    # VNNI's byte dot product (vpdpbusd) where the build has it, its two-instruction form where not: the same integers
    "avx512_vnni": [*_AVX512_FLAGS, "-mavx512vnni"],
    "avx512": _AVX512_FLAGS,
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_log = logging.getLogger(__name__)


def format_macros() -> list[str]:
    """The format table as the C++ source reads it, ``-DWB_<FORMAT>_TYPE=..``, ``-DWB_<FORMAT>_VALUES=..`` and
    ``-DWB_<FORMAT>_BYTES=..``, for every format the extension reads and every activation block of llama.cpp
    numerics."""
    names = dict.fromkeys([*SUPPORTED_TYPES.values(), *(SPECS[name].activation for name in SUPPORTED_TYPES.values())])
    return [f"-DWB_{name}_{field}={value}" for name in names for field, value in
            (("TYPE", SPECS[name].ggml_type), ("VALUES", SPECS[name].block_size), ("BYTES", SPECS[name].type_size))]


def _native_isa() -> str:
    """The widest instruction set the extension has code for that this CPU runs (torch's own probes)."""
    isa = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "scalar")
    capabilities = getattr(torch.cpu, "get_capabilities", dict)()
    if isa != "avx512" or not capabilities.get("avx512_vnni", False):
        return isa
    return "avx512_amx" if capabilities.get("amx_int8", False) and capabilities.get("amx_tile", False) else "avx512_vnni"


def _build_stamp(name: str, source: Path, cflags: list[str]) -> Path:
    """Where the path of this build's library is noted: one file per source, flags, torch, Python and extensions
    directory, so that any change of them misses it and builds through ``cpp_extension`` again."""
    key = hashlib.sha256("\0".join([
        source.read_text(), *cflags, torch.__version__, sys.version, os.environ.get("TORCH_EXTENSIONS_DIR", ""),
    ]).encode()).hexdigest()[:24]
    return cache_dir("cpu_kernels") / f"{name}-{key}.path"


def _build_extension(isa: str, source: Path = _SOURCE, name: str | None = None) -> Any:
    """Build (or load the cached build of) the kernels for ``isa``; they register as ``torch.ops.<name>.*``. Another
    ``source`` (an older revision's, for a before/after in one process, ``bench/moe.py --kernels-from``) takes a
    ``name`` of its own.

    A library this source and these flags already built is loaded straight from the path noted in its stamp:
    ``cpp_extension.load`` imports setuptools and runs ninja to find the build up to date, ~0.5 s of a first call
    (docs/performance.md, "Load time and memory")."""
    name = name or f"workbench_cpu_kernels_{isa}"
    cflags = ["-O3", "-fopenmp", *_ISA_FLAGS[isa], *format_macros()]
    stamp = _build_stamp(name, source, cflags)
    # the library's path and modification time: a build of another source in the same folder since then replaced it
    noted = stamp.read_text().split("\n") if stamp.is_file() else []
    try:
        if len(noted) != 2 or not Path(noted[0]).is_file() or str(Path(noted[0]).stat().st_mtime_ns) != noted[1]:
            raise OSError("no build noted")
        torch.ops.load_library(noted[0])
    except OSError:
        _log.info("building workbench CPU kernels (%s); the first build takes about a minute", isa)
        from torch.utils.cpp_extension import load

        load(name=name, sources=[str(source)], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
             is_python_module=False)
        # the file named for this build exactly: another build's name may begin with it (avx512, avx512_vnni)
        library = next((p for p in torch.ops.loaded_libraries if Path(p).name.split(".")[0] == name), None)
        if library is not None:
            stamp.write_text(f"{library}\n{Path(library).stat().st_mtime_ns}")
    ops = getattr(torch.ops, name)
    # Output shapes for torch.compile's tracing; the ops themselves only run on real CPU tensors.
    torch.library.register_fake(f"{name}::linear_exact")(
        lambda x, packed, ggml_types, rows, cols, panel_min_batch: x.new_empty(x.shape[0], sum(rows))
    )
    torch.library.register_fake(f"{name}::linear_exact_segments")(
        lambda x, packed, ggml_types, rows, cols, x_first, x_count, panel_min_batch: x.new_empty(sum(x_count), rows)
    )
    torch.library.register_fake(f"{name}::linear_llamacpp")(
        lambda x, packed, ggml_type, rows, cols: x.new_empty(x.shape[0], sum(rows))
    )
    torch.library.register_fake(f"{name}::linear_llamacpp_segments")(
        lambda x, packed, ggml_type, rows, cols, x_first, x_count: x.new_empty(sum(x_count), rows)
    )
    torch.library.register_fake(f"{name}::lora_add")(
        lambda x, a, b_t, outs, ranks, parallel_work: x.new_empty(x.shape[0], b_t.shape[1])
    )
    return ops


# "ops": the extension's op namespace, or None where it could not be built; absent until extension() first runs.
# A plain dict rather than functools.cache, so that torch.compile reads the result instead of tracing a build.
_extension: dict[str, Any] = {}


def extension() -> Any | None:
    """The compiled kernels' op namespace, built on first call; None (after one warning) if they cannot be built."""
    if "ops" not in _extension:
        _extension["ops"] = _build_or_warn(_native_isa())
    return _extension["ops"]


def _build_or_warn(isa: str) -> Any | None:
    try:
        return _build_extension(isa)
    except Exception as err:  # no compiler, no headers, a failed build: all degrade the same way
        if isa == "avx512_amx":  # a compiler without AMX's intrinsics (GCC before 11) still builds the VNNI kernels
            _log.info("the AMX build failed (%s); building the AVX-512 VNNI kernels", err)
            return _build_or_warn("avx512_vnni")
        warnings.warn(
            f"workbench.kernels.cpu: could not build the C++ CPU kernels ({isa}): {err}. "
            f"Quantized CPU matmuls fall back to the slow '{BLOCKWISE.name}' path.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def quantize_activations(x: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The Q8 blocks (GGUF byte layout, ``[M, bytes]``) llama.cpp numerics feed to a weight of ``ggml_type``."""
    ext = extension()
    if ext is None:
        raise RuntimeError("workbench.kernels.cpu: the C++ CPU kernels are not available")
    return ext.quantize_activations(x.to(torch.float32).contiguous(), ggml_type)


def _runs_here(x: torch.Tensor, w: QuantTensor) -> bool:
    return (
        x.is_cpu
        and x.dtype in _FLOAT_DTYPES
        and w.fmt.ggml_type in SUPPORTED_TYPES
        and extension() is not None
    )


def _in_float32(x: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The kernels take and return float32; other float inputs are converted (skipped when already fp32: ~2 us a call)."""
    if x.dtype == torch.float32:
        return compute(x)
    return compute(x.float()).to(x.dtype)


def _run_exact_parts(x: torch.Tensor, parts: Sequence[QuantTensor]) -> torch.Tensor:
    def compute(x32: torch.Tensor) -> torch.Tensor:
        return extension().linear_exact(
            x32, [w.data for w in parts], [w.fmt.ggml_type for w in parts], [w.shape[0] for w in parts],
            parts[0].shape[1], PANEL_MIN_BATCH,
        )

    return _in_float32(x, compute)


def _run_exact_segments(x: torch.Tensor, parts: Sequence[QuantTensor], starts: Sequence[int],
                        counts: Sequence[int]) -> torch.Tensor:
    def compute(x32: torch.Tensor) -> torch.Tensor:
        return extension().linear_exact_segments(
            x32, [w.data for w in parts], [w.fmt.ggml_type for w in parts], *parts[0].shape, list(starts),
            list(counts), PANEL_MIN_BATCH,
        )

    return _in_float32(x, compute)


def _run_exact(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    return _run_exact_parts(x, (w,))


def _run_llamacpp_parts(x: torch.Tensor, parts: Sequence[QuantTensor]) -> torch.Tensor:
    fmt = parts[0].fmt
    if any(w.fmt.ggml_type != fmt.ggml_type for w in parts):  # the op quantizes the activations for one weight type
        return torch.cat([_run_llamacpp(x, w) for w in parts], dim=-1)
    return _in_float32(x, lambda x32: extension().linear_llamacpp(
        x32, [w.data for w in parts], fmt.ggml_type, [w.shape[0] for w in parts], parts[0].shape[1]))


def _run_llamacpp(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    return _run_llamacpp_parts(x, (w,))


def _run_llamacpp_segments(x: torch.Tensor, parts: Sequence[QuantTensor], starts: Sequence[int],
                           counts: Sequence[int]) -> torch.Tensor:
    fmt = parts[0].fmt
    if any(w.fmt.ggml_type != fmt.ggml_type for w in parts):  # the op quantizes the activations for one weight type
        return torch.cat([_run_llamacpp(x[start:start + count], w) for w, start, count in zip(parts, starts, counts)])
    return _in_float32(x, lambda x32: extension().linear_llamacpp_segments(
        x32, [w.data for w in parts], fmt.ggml_type, *parts[0].shape, list(starts), list(counts)))


def _dequantize(w: QuantTensor) -> torch.Tensor:
    return extension().dequantize(w.data.contiguous(), w.fmt.ggml_type, w.shape[1])


EXACT = Kernel("cpu-gguf-exact", "cpu", _runs_here, _run_exact, _run_exact_parts, _run_exact_segments, traceable=True,
               formats=tuple(SUPPORTED_TYPES.values()), by_type=True, dequantize=_dequantize)
LLAMACPP = Kernel("cpu-gguf-llamacpp", "cpu", _runs_here, _run_llamacpp, _run_llamacpp_parts, _run_llamacpp_segments,
                  traceable=True, numerics="llamacpp", formats=tuple(SUPPORTED_TYPES.values()), by_type=True,
                  dequantize=_dequantize)
register_kernel(EXACT)
register_kernel(LLAMACPP)

__all__ = [
    "EXACT",
    "LLAMACPP",
    "PANEL_MIN_BATCH",
    "SUPPORTED_TYPES",
    "extension",
    "get_numerics",
    "numerics",
    "quantize_activations",
    "set_numerics",
]
