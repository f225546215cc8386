"""Tiny random transformers MoE checkpoints with a tokenizer, and llama.cpp's converter, shared by tests/test_moe.py and
scripts/make_moe_fixtures.py (which writes the llama.cpp reference fixtures)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_loading import write_hf_tokenizer
from workbench.synthetic import random_hf_checkpoint

FAMILIES = ("mixtral", "qwen3moe", "qwen2moe")
LLAMA_CPP_SOURCE = Path(os.environ.get("WORKBENCH_LLAMA_CPP_SOURCE",
                                       "/work/cache/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def hf_moe_model(family: str, path: Path, n_layers: int = 2, **settings):
    """``workbench.synthetic.random_hf_checkpoint`` of an MoE family (untied, ``settings`` override config keys) with
    our byte-level tokenizer, as llama.cpp's converter needs one."""
    model = random_hf_checkpoint(family, path, n_layers=n_layers, tie=False, **settings)
    write_hf_tokenizer(path)
    return model


# convert_hf_to_gguf.py, told to use the default pre-tokenizer: our tiny byte-level tokenizer is not one of those it
# knows by hash
_CONVERT = """import runpy, sys
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_with_llama_cpp(hf_dir: Path, out: Path) -> Path:
    """llama.cpp's own converter (float32), run from its source tree with its own gguf-py, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LLAMA_CPP_SOURCE), str(LLAMA_CPP_SOURCE / "gguf-py")])}
    subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py"), str(hf_dir),
                    "--outfile", str(out), "--outtype", "f32"], env=env, check=True, capture_output=True)
    return out


def quantize_with_llama_cpp(source: Path, out: Path, ftype: str) -> Path:
    """``llama_model_quantize`` (the optional ``reference`` extra's llama-cpp-python) of a GGUF into ``ftype``, a
    ``LLAMA_FTYPE_*`` name such as ``"LLAMA_FTYPE_MOSTLY_Q4_K_M"``."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source}")
    return out
