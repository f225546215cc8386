"""Errors a user can act on. Surfaces print their message without a traceback."""


class WorkbenchError(Exception):
    """Base class: bad input or an unsupported request, with a message that names the problem."""


class ModelLoadError(WorkbenchError):
    """A model file or checkpoint is missing, corrupt, truncated or of an unsupported kind."""


class HookError(WorkbenchError, ValueError):
    """An unknown hook point, or an intervention that does not fit the activation it targets."""


class QuantizeError(WorkbenchError, ValueError):
    """A quantization to load into that is neither a known format nor a known mix."""
