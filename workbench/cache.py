"""Where workbench keeps what it builds once per machine: ``$WORKBENCH_CACHE_DIR``, else ``~/.cache/workbench``."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache directory (or a folder inside it), created if missing."""
    root = os.environ.get("WORKBENCH_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                          "workbench")
    path = Path(root, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
