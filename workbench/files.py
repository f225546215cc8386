"""Files in folders someone else may have written: writing without ever writing through a link planted there (trace
artifacts, cache notes), and reading only regular files, never a link out of a folder confined reads may not leave."""
from __future__ import annotations

import json
import os
import secrets
import stat
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator

from workbench.errors import WorkbenchError

# Where reads are confined: None (the Python API and the command line load what they are given) or, inside MCP tool
# calls, the artifacts folder, so that a file, folder or manifest a client wrote cannot lead a read out of it.
_READ_ROOT: ContextVar[Path | None] = ContextVar("workbench_read_root", default=None)


@contextmanager
def reads_within(root: str | Path) -> Iterator[None]:
    """Inside the block (this thread or task only), paths named by files (SAE specs) load only from inside ``root``,
    and members of folders (SAE, adapter and checkpoint folders) that are symbolic links are refused."""
    token = _READ_ROOT.set(Path(root).resolve())
    try:
        yield
    finally:
        _READ_ROOT.reset(token)


def read_root() -> Path | None:
    """The folder reads are confined to (``reads_within``), or None."""
    return _READ_ROOT.get()


def regular_file(path: Path, error: type[WorkbenchError] = WorkbenchError, *, links: bool = True) -> Path:
    """``path``, refused (``error``) unless it is a regular file: opening a FIFO or device would block or never end.
    A symbolic link is followed only where ``links`` allows it and reads are not confined (``reads_within``)."""
    try:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            if not links or read_root() is not None:
                raise error(f"{path} is a symbolic link; refused")
            info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    except OSError as err:
        raise error(f"{path} cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path} is not a regular file (a FIFO, device or folder); refused")
    return path


def parse_json(text: str | bytes, where: str, error: type[WorkbenchError] = WorkbenchError) -> Any:
    """The JSON value of ``text`` (``where`` names it in errors): text that is not UTF-8 JSON, nests past Python's
    recursion limit or holds an integer of more digits than Python converts is ``error`` in one line."""
    try:
        return json.loads(text)
    except ValueError as err:  # invalid JSON, invalid UTF-8 bytes, or an integer of too many digits
        raise error(f"{where}: not valid JSON ({str(err)[:120]})") from None
    except RecursionError:
        raise error(f"{where}: nests too deeply to be read") from None


def read_json(path: Path, error: type[WorkbenchError] = WorkbenchError) -> Any:
    """The JSON value of the regular file ``path`` (``regular_file``), with ``parse_json``'s errors."""
    try:
        data = regular_file(path, error).read_bytes()
    except OSError as err:
        raise error(f"{path} cannot be read ({err.strerror})") from None
    return parse_json(data, str(path), error)


@contextmanager
def open_folder(directory: Path, error: type[WorkbenchError] = WorkbenchError) -> Iterator[int]:
    """A descriptor of the folder itself, never of a link: its members are then opened relative to it."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise error(f"{directory}: no such folder") from None
    except OSError as err:
        raise error(f"{directory} cannot be opened as a folder (a symbolic link or not a folder: "
                    f"{err.strerror})") from None
    try:
        yield fd
    finally:
        os.close(fd)


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
