"""Writing a file into a folder without ever writing through a link planted there (trace artifacts, cache notes)."""
from __future__ import annotations

import os
import secrets
from contextlib import suppress


def replace_file(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``name`` in the directory open at ``dir_fd``: a fresh temporary file (O_EXCL, O_NOFOLLOW, so never through
    a planted link) renamed over it, which replaces a directory entry and never writes through one."""
    temporary = f".{name}.{secrets.token_hex(8)}.tmp"
    out = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(out, "wb") as f:
            f.write(data)
        os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
