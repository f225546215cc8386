"""Progress reports for long calls: None or False (silent), True (a tqdm bar) or ``callable(done, total)``."""
from __future__ import annotations

from typing import Any, Callable

from workbench.errors import WorkbenchError

Progress = bool | Callable[[int, int], Any] | None


def progress_callback(progress: Progress, total: int,
                      description: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(update(done), close()) for ``progress``: None (silent), True (a tqdm bar) or ``callable(done, total)``."""
    check_progress(progress)
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=description)
        return (lambda done: bar.update(done - bar.n)), bar.close
    if callable(progress):
        return (lambda done: progress(done, total)), (lambda: None)
    return (lambda done: None), (lambda: None)


def check_progress(progress: Progress) -> Progress:
    """``progress`` as given, or a clear error: for a call to refuse before it computes (or opens a bar)."""
    if not (progress is True or callable(progress) or progress in (None, False)):
        raise WorkbenchError(f"progress must be None, True or a callable(done, total), got {progress!r}")
    return progress
