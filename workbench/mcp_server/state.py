"""Server-side state of the MCP server: request limits, per-session objects, the artifacts folder, models."""
from __future__ import annotations

import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator


from workbench.errors import WorkbenchError, shorten
from workbench.hooks import Trace
from workbench.kv_cache import KVCache


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how much one session may keep."""

    max_prompt_tokens: int = 512
    max_batch: int = 128  # prompts in one request: references, donors, datasets
    max_new_tokens: int = 256
    max_sweep: int = 256  # forwards in one patching sweep
    max_values: int = 8192  # numbers in any tensor slice a tool returns
    max_top_k: int = 50
    max_interventions: int = 16
    max_record_values: int = 32_000_000  # floats one run may record (128 MiB)
    max_objects: int = 256  # traces, caches, probes and vectors held by one session
    max_session_bytes: int = 1 << 30  # their tensors, all together
    max_models: int = 2  # models resident at once (the default one included)
    idle_seconds: float = 1800.0  # a session unused this long is released
    max_train_seconds: float = 600.0  # one sae_train call
    max_sae_features: int = 65_536  # features of an SAE sae_train makes
    max_sae_batch_tokens: int = 4096  # tokens of one sae_train step


class Cancelled(WorkbenchError):
    """The client cancelled the request; work stopped at the next step boundary."""


@dataclass
class Entry:
    kind: str  # "trace", "cache", "probe", "vector"
    value: Any
    note: dict[str, Any] = field(default_factory=dict)  # a few facts shown by the list tools


class Session:
    """One client's server-side objects, by id. Ids are random, so they cannot be guessed across sessions."""

    def __init__(self, key: str, limits: Limits, model_name: str, numerics: str = "exact"):
        self.key = key
        self.limits = limits
        self.model_name = model_name
        self.numerics = numerics  # what this session's quantized matmuls compute (the set_numerics tool)
        self.entries: dict[str, Entry] = {}
        self.last_used = time.monotonic()  # when its last call ended
        self.calls = 0  # calls in flight, waiting for the model or running: a busy session is never idle

    def put(self, kind: str, value: Any, **note: Any) -> str:
        return self.put_all(kind, [value], **note)[0]

    def put_all(self, kind: str, values: list[Any], **note: Any) -> list[str]:
        """Keep every value, or (past the limits) none."""
        self.check_room(len(values), sum(map(_nbytes, values)))
        ids = []
        for value in values:
            object_id = f"{kind}-{secrets.token_hex(4)}"
            while object_id in self.entries:
                object_id = f"{kind}-{secrets.token_hex(4)}"
            self.entries[object_id] = Entry(kind, value, dict(note))  # each its own: save_trace adds a path
            ids.append(object_id)
        return ids

    def check_room(self, objects: int, nbytes: int) -> None:
        """Refuse what would take the session past its limits: ``objects`` more objects, ``nbytes`` more bytes (of new
        objects, or of held ones that grow)."""
        held = sum(_nbytes(e.value) for e in self.entries.values())
        if (len(self.entries) + objects > self.limits.max_objects
                or held + nbytes > self.limits.max_session_bytes):
            raise WorkbenchError(f"this session holds {len(self.entries)} objects of {held / 2**20:.0f} MiB; the "
                                 f"limits are {self.limits.max_objects} objects and "
                                 f"{self.limits.max_session_bytes / 2**20:.0f} MiB: free some (release, kv_release)")

    def entry(self, kind: str, object_id: str) -> Entry:
        entry = self.entries.get(object_id)
        if entry is None or entry.kind != kind:
            held = [i for i, e in self.entries.items() if e.kind == kind]
            listing = ", ".join(held[-5:]) if held else "none"
            raise WorkbenchError(f"unknown {kind} id {shorten(object_id)}; this session holds: {listing}")
        return entry

    def get(self, kind: str, object_id: str) -> Any:
        return self.entry(kind, object_id).value

    def release(self, object_id: str) -> Entry:
        entry = self.entries.pop(object_id, None)
        if entry is None:
            raise WorkbenchError(f"unknown id {shorten(object_id)}")
        return entry

    def of_kind(self, kind: str) -> dict[str, Entry]:
        return {i: e for i, e in self.entries.items() if e.kind == kind}


def _nbytes(value: Any) -> int:
    """Memory held by a server-side object's tensors."""
    if isinstance(value, Trace):
        return sum(t.nbytes for t in value.tensors().values())
    if isinstance(value, KVCache):
        return value.nbytes
    return 0


class Sessions:
    """Sessions by key (the transport's session id), released on disconnect or after an idle limit. A new session
    starts on ``default_model`` in ``default_numerics``, the server's."""

    def __init__(self, limits: Limits, default_model: str, default_numerics: str):
        self.limits = limits
        self._default_model = default_model
        self._default_numerics = default_numerics
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    @contextmanager
    def using(self, key: str) -> Iterator[Session]:
        """The session of ``key`` (made on first use), busy for the block: a call that waits for the model or runs
        longer than the idle limit keeps its session, and the idle clock starts when the call ends."""
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = Session(key, self.limits, self._default_model, self._default_numerics)
            session.calls += 1
        try:
            yield session
        finally:
            with self._lock:
                session.calls -= 1
                session.last_used = time.monotonic()

    def release(self, key: str) -> bool:
        with self._lock:
            return self._sessions.pop(key, None) is not None

    def expire_idle(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [k for k, s in self._sessions.items()
                    if not s.calls and now - s.last_used > self.limits.idle_seconds]
            for key in idle:
                del self._sessions[key]
        return idle

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def models_in_use(self, besides: Session | None = None) -> set[str]:
        """The models sessions use, leaving out ``besides``'s (a model it shares with another session stays in)."""
        with self._lock:
            return {s.model_name for s in self._sessions.values() if s is not besides}


class Artifacts:
    """The one folder tools read and write. Any path resolving outside it is refused."""

    def __init__(self, root: str | Path):
        if isinstance(root, str) and not root.strip():
            raise WorkbenchError("the artifacts folder is an empty path")
        self.root = Path(root).expanduser().resolve()
        if self.root.exists() and not self.root.is_dir():
            raise WorkbenchError(f"the artifacts folder {self.root} exists and is not a folder")

    def path(self, relative: str, must_exist: bool = False) -> Path:
        """The absolute path of ``relative`` inside the folder (absolute paths must already point inside it)."""
        if not isinstance(relative, str) or not relative.strip() or "\x00" in relative:
            raise WorkbenchError(f"a path must be a non-empty string, got {shorten(relative)}")
        candidate = Path(relative).expanduser()
        if not candidate.is_absolute():
            candidate = self.root / candidate
        # resolve() follows symlinks, so a link inside the folder that points out of it is refused too
        resolved = candidate.resolve()
        if resolved != self.root and not resolved.is_relative_to(self.root):
            raise WorkbenchError(f"path {shorten(relative)} is outside the artifacts folder {self.root}; refused")
        if must_exist and not resolved.is_file():
            raise WorkbenchError(f"no file {shorten(relative)} in the artifacts folder {self.root}")
        return resolved

    def target(self, relative: str) -> Path:
        """Where to write ``relative`` (its parent folders created); never the folder itself."""
        path = self.path(relative)
        if path == self.root:
            raise WorkbenchError(f"{shorten(relative)} is the artifacts folder itself; give a name inside it")
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    def files(self, pattern: str) -> list[str]:
        if not self.root.is_dir():
            return []
        found = (p.resolve() for p in self.root.rglob(pattern))
        return sorted(self.relative(p) for p in found if p.is_file() and p.is_relative_to(self.root))


class Models:
    """Resident models by name: the server's default, plus those sessions loaded (dropped when unused)."""

    EMBEDDED = "embedded"

    def __init__(self, default: Any, default_name: str, limits: Limits,
                 loader: Callable[[Path | None, str | None], Any]):
        self.default_name = default_name
        self.limits = limits
        self._loader = loader
        self._models: dict[str, Any] = {default_name: default}
        self._paths: dict[str, str] = {default_name: str(default.path)}
        self._lock = threading.Lock()

    def get(self, name: str) -> Any:
        with self._lock:
            model = self._models.get(name)
        if model is None:
            raise WorkbenchError(f"model {name!r} is no longer loaded; call load_model again")
        return model

    def loaded(self) -> dict[str, str]:
        with self._lock:
            return dict(self._paths)

    def load(self, name: str, path: Path | None, in_use: set[str], quantize: str | None = None,
             replaces: str | None = None) -> Any:
        """The model called ``name`` (loading it from ``path`` first, None meaning the embedded one, quantized on load
        as ``quantize`` says). Models no session uses are dropped to make room; ``replaces``, the model the caller
        leaves, only once the new one has loaded, so that a failed load loses nothing."""
        with self._lock:
            if name in self._models:
                return self._models[name]
            droppable = [n for n in self._models if n != self.default_name and n not in in_use]
            for unused in droppable:
                if unused != replaces:
                    del self._models[unused], self._paths[unused]
            if len(self._models) - (replaces in droppable) >= self.limits.max_models:
                raise WorkbenchError(f"{len(self._models)} models are resident (the limit) and in use by sessions: "
                                     f"{', '.join(self._models)}")
            model = self._loader(path, quantize)
            if replaces in droppable:
                del self._models[replaces], self._paths[replaces]
            self._models[name] = model
            self._paths[name] = str(model.path)
            return model
