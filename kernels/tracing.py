"""Whether the code running now is being traced by ``torch.compile``.

``torch.compiler.is_compiling()`` alone says so inside traced code, but in eager code it reads a process-wide flag
that is True for as long as any thread compiles: an eager forward beside a decode step compiling in the background
(``workbench.generation``) would take the traced code's branches. The tracing context is per thread.
"""
from __future__ import annotations

import torch
import torch._guards

# What ``torch.compiler.assume_constant_result`` marks on a function (tests/test_runner.py checks that it still is),
# set here without it: the decorator imports torch._dynamo, a second of every process's start that only a compile needs.
CONSTANT_RESULT_MARK = "_dynamo_marked_constant"


def _tracing_in_this_thread() -> bool:
    return torch._guards.TracingContext.try_get() is not None


setattr(_tracing_in_this_thread, CONSTANT_RESULT_MARK, True)


def compiling() -> bool:
    """True while ``torch.compile`` traces this code (in this thread), False in eager code."""
    return torch.compiler.is_compiling() and _tracing_in_this_thread()


def tracks_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records the ops on any of ``tensors`` (a gradient run, ``Model.run_with_gradients``): the
    kernels without a backward then run inside wrappers that have one, or give way to the torch formulas. The
    attribute reads come first: this runs per op call."""
    for t in tensors:
        if t.requires_grad:
            return torch.is_grad_enabled()
    return False
