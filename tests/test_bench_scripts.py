"""Every script in bench/ imports: a renamed kernel helper must not leave a benchmark broken until its next GPU run.

The scripts import each other as top-level modules (``common``, ``kernels``), so they are imported in a child
process whose path starts at bench/: a module named ``kernels`` must not stay behind in the test process, where it
would shadow the Hugging Face package of that name.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(path.stem for path in BENCH.glob("*.py"))

_IMPORT_ALL = """
import importlib, json, sys
failures = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as err:
        failures[name] = f"{type(err).__name__}: {err}"
print(json.dumps(failures))
"""


def test_every_bench_script_imports():
    pytest.importorskip("triton")  # the CUDA benchmarks define their Triton kernels at import
    assert "kernels" in SCRIPTS and "gemv_breakdown" in SCRIPTS
    result = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *SCRIPTS], cwd=BENCH, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert failures == {}, failures


def test_every_launch_choice_names_a_bench_command_that_runs():
    """Each row of the launch-choice table names the benchmark that measures it: a script in bench/ and options it
    takes, and the section of docs/performance.md with the measurements."""
    from workbench.kernels.launch_choices import CHOICES

    for choice in CHOICES:
        argv = shlex.split(choice.bench)
        assert argv[0] == "python" and argv[1].startswith("bench/"), choice
        script = BENCH.parent / argv[1]
        assert script.is_file(), choice
        source = script.read_text()
        for flag in (arg.split("=")[0] for arg in argv[2:] if arg.startswith("--")):
            assert f'"{flag}"' in source, (choice.setting, choice.bench, flag)
        assert choice.docs.startswith("docs/performance.md, "), choice
