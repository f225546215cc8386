"""workbench: record, ablate, steer and patch the activations of LLMs running on their production kernels."""
from workbench import distributed
from workbench.config import ModelConfig
from workbench.errors import HookError, ModelLoadError, WorkbenchError
from workbench.hooks import Trace, load_trace
from workbench.model import Model, load
from workbench.replay import ReplayReport, replay

__version__ = "0.1.0"

__all__ = ["load", "Model", "ModelConfig", "WorkbenchError", "ModelLoadError", "HookError", "Trace", "load_trace",
           "replay", "ReplayReport", "distributed", "__version__"]
