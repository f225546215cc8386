"""Data-parallel sweeps on torch.distributed: work items sharded over the ranks of a ``torchrun`` job, each shard's
results gathered exactly once, in the items' order.

Launch any script that calls these functions with ``torchrun --nproc-per-node N script.py`` (``--nnodes`` and a
rendezvous for several machines); without torchrun it runs as one process and gives the same results. Each rank loads
its own model (``cuda:LOCAL_RANK``, or a layer split over ``local_devices(per_rank)``) and runs its shards in batched
forwards. torch.distributed, not Ray: it is what GPU-cluster jobs already launch (torchrun under Slurm or Kubernetes,
NCCL between GPUs) and it comes with torch, so a sweep needs no other dependency or cluster service.

Items are cut into shards of ``shard_size`` consecutive items. Each rank claims the next unclaimed shard from a counter
in the job's store when it is free, so a faster GPU takes more shards and no rank idles at the end waiting for a slower
one (a static ``s % world`` split let one rank's 10 % slower run decide the sweep's time). A shard whose work raises is
retried on the rank after the one where it failed, up to ``retries`` times; its results count only when a run of it
finishes, so a failed attempt loses and duplicates nothing. A rank that dies takes the job down
(torchrun stops the others, so nothing hangs); with ``torchrun --max-restarts``, a harvest to files skips the shards
whose files are already written. Results travel between ranks through the backend's all-gather: their tensors as
raw bytes packed on the backend's device (the GPU for NCCL), the structure around them through ``all_gather_object``
(pickle among the job's own processes, never data from elsewhere).
"""
from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist

from workbench.errors import WorkbenchError, clip, shorten
from workbench.files import open_folder, read_json, regular_file, replace_file

T = TypeVar("T")
R = TypeVar("R")

HARVEST_FORMAT = "workbench-harvest/1"


@dataclass(frozen=True)
class Shard:
    """A run of consecutive work items: ``items`` are ``all_items[start:start + len(items)]``."""

    index: int
    start: int
    items: list


@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    local_rank: int


def init(backend: str | None = None, timeout_s: float = 1800.0, cpu_threads: int | None = None) -> Rank:
    """Join the process group torchrun describes in the environment (gloo on the CPU, NCCL where CUDA is present,
    each rank on ``cuda:LOCAL_RANK``); without torchrun, one process of rank 0. Idempotent.

    ``cpu_threads``: torch's CPU threads in this rank. By default a GPU rank that torchrun left one thread (its
    ``OMP_NUM_THREADS=1`` for several ranks a machine) gets its share of the machine's cores: GPU ranks still copy
    recorded activations and build batches on the CPU, and with one thread that work serializes."""
    if dist.is_available() and dist.is_initialized():
        return this_rank()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Rank(0, 1, 0)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        if cpu_threads is None and torch.get_num_threads() == 1:
            cpu_threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if cpu_threads is not None:
        if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1:
            raise WorkbenchError(f"cpu_threads must be a positive integer, got {cpu_threads!r}")
        torch.set_num_threads(cpu_threads)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    atexit.register(_leave_process_group)
    return this_rank()


def _leave_process_group() -> None:
    # torch asks that a process group be destroyed before its process exits: a rank that exits with it alive can
    # abort in C++ at interpreter shutdown ("terminate called without an active exception"), failing a finished job
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def this_rank() -> Rank:
    if dist.is_available() and dist.is_initialized():
        return Rank(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return Rank(0, 1, 0)


def local_devices(per_rank: int = 1) -> list[str]:
    """The devices of this rank: ``per_rank`` consecutive GPUs of its host (``devices=`` for a layer split when
    ``per_rank > 1``), or the CPU without CUDA."""
    if not torch.cuda.is_available():
        return ["cpu"] * per_rank
    first = this_rank().local_rank * per_rank
    if first + per_rank > torch.cuda.device_count():
        raise WorkbenchError(f"local rank {this_rank().local_rank} needs GPUs {first}..{first + per_rank - 1}; this "
                             f"host has {torch.cuda.device_count()}")
    return [f"cuda:{first + i}" for i in range(per_rank)]


def _all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, its tensors on the CPU. The tensors inside travel as one byte buffer per
    rank through the backend's own all-gather, packed where the backend reads (on the GPU for NCCL: a GPU result is
    copied once on the device, not read back first); only the small skeleton around them is pickled. Pickling each of
    a sweep's per-prompt rows instead cost more than the sweep's compute on two GPUs."""
    rank = this_rank()
    if rank.world == 1:
        return [_tree_map(value, lambda x: x.cpu(), torch.Tensor)]
    chunks: list[tuple[_Slot, torch.Tensor]] = []
    size = 0

    def to_slot(x: torch.Tensor) -> _Slot:
        nonlocal size
        data = x.detach().contiguous().reshape(-1).view(torch.uint8)
        slot = _Slot(size, data.numel(), x.dtype, tuple(x.shape))
        chunks.append((slot, data))
        size += -(-data.numel() // _ALIGN) * _ALIGN  # every slot starts aligned for any dtype's view
        return slot

    skeleton = _tree_map(value, to_slot, torch.Tensor)
    skeletons: list[Any] = [None] * rank.world
    dist.all_gather_object(skeletons, (skeleton, size))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    local = torch.zeros(max(n for _, n in skeletons), dtype=torch.uint8, device=device)
    for slot, data in chunks:
        local[slot.offset:slot.offset + slot.nbytes].copy_(data, non_blocking=True)
    buffers = [torch.empty_like(local) for _ in range(rank.world)]
    dist.all_gather(buffers, local)
    return [_tree_map(part, lambda slot, data=buffer.cpu(): slot.tensor(data), _Slot)
            for (part, _), buffer in zip(skeletons, buffers)]


_ALIGN = 16


@dataclass(frozen=True)
class _Slot:
    """Where a gathered tensor lies in its rank's byte buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def tensor(self, data: torch.Tensor) -> torch.Tensor:
        return data[self.offset:self.offset + self.nbytes].view(self.dtype).reshape(self.shape)


def _tree_map(value: Any, fn: Callable[[Any], Any], leaf: type) -> Any:
    """``value`` with ``fn`` applied to every ``leaf`` inside its dicts, lists and tuples."""
    if isinstance(value, leaf):
        return fn(value)
    if isinstance(value, dict):
        return {k: _tree_map(v, fn, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tree_map(v, fn, leaf) for v in value)
    return value


def run_sharded(items: Sequence[T], work: Callable[[Shard], Sequence[R]], *, shard_size: int = 64,
                retries: int = 2) -> list[R]:
    """``work(shard)`` over shards of ``items`` on every rank, one result per item: on every rank, the results of all
    items in their order (tensors on the CPU). Every rank must call this with the same items (it is a collective)."""

    def checked(shard: Shard) -> list[R]:
        out = list(work(shard))
        if len(out) != len(shard.items):
            raise WorkbenchError(f"the work gave {len(out)} results for {len(shard.items)} items")
        return out

    return [result for out in _run_shards(items, checked, shard_size, retries) for result in out]


def _run_shards(items: Sequence[T], work: Callable[[Shard], Any], shard_size: int, retries: int) -> list[Any]:
    """``work(shard)`` of every shard of ``items``, in the shards' order, on every rank: each shard's result travels
    whole (a harvest's ``[rows, ...]`` tensors as one slot each, not one per prompt)."""
    items = list(items)
    if not items:
        raise WorkbenchError("no work items given")
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise WorkbenchError(f"shard_size must be a positive integer, got {shard_size!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise WorkbenchError(f"retries must be a non-negative integer, got {retries!r}")
    rank = this_rank()
    shards = [Shard(s, start, items[start:start + shard_size])
              for s, start in enumerate(range(0, len(items), shard_size))]
    gathered: dict[int, Any] = {}
    errors: dict[int, str] = {}
    owners: dict[int, int] = {}  # the rank each failed shard's next attempt runs on
    for attempt in range(retries + 1):
        mine = _claimed(len(shards)) if attempt == 0 else (s for s, r in owners.items() if r == rank.rank)
        done, failed = {}, {}
        for s in mine:
            try:
                done[s] = work(shards[s])
            except Exception as err:  # noqa: BLE001 - any failure of a shard is retried, then reported
                failed[s] = (rank.rank, f"{type(err).__name__}: {err}")
        # one gather a round: the results, and which shards failed where, so that all ranks agree on the next round
        # (each failed shard on the rank after the one where it failed)
        failed_anywhere = {}
        for part_done, part_failed in _all_gather((done, failed)):
            for s, out in part_done.items():
                if s in gathered:
                    raise WorkbenchError(f"shard {s} came back from two ranks")
                gathered[s] = out
            failed_anywhere.update(part_failed)
        errors.update({s: message for s, (_, message) in failed_anywhere.items()})
        owners = {s: (where + 1) % rank.world for s, (where, _) in sorted(failed_anywhere.items())}
        if not owners:
            break
    if owners:
        pending = sorted(owners)
        s = pending[0]
        first = shards[s].start
        raise WorkbenchError(f"shard {s} (items {first}..{first + len(shards[s].items) - 1}) failed {retries + 1} "
                             f"times; last error: {errors[s]}" + (f" ({len(pending) - 1} more shards failed)"
                                                                  if len(pending) > 1 else ""))
    missing = sorted(set(range(len(shards))) - gathered.keys())
    if missing:
        raise WorkbenchError(f"shards {missing} came back from no rank")
    return [gathered[s] for s in range(len(shards))]


_sweeps = itertools.count()  # every rank calls the sweeps in the same order, so the n-th sweep has one key on all


def _claimed(n_shards: int) -> Iterator[int]:
    """The shards this rank runs in a sweep's first round: each the next unclaimed one, taken from a counter in the
    job's store when the rank is free (every shard on the single process of a one-rank job)."""
    if this_rank().world == 1:
        yield from range(n_shards)
        return
    # the job's store outlives a restart of its workers (torchrun --max-restarts): the key names the attempt too
    key = (f"workbench/sweep/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/{next(_sweeps)}")
    store = dist.distributed_c10d._get_default_store()
    while (s := store.add(key, 1) - 1) < n_shards:
        yield s


def sweep(items: Sequence[T], fn: Callable[[T], R], *, shard_size: int = 16, retries: int = 2) -> list[R]:
    """``[fn(item) for item in items]``, the items sharded over the ranks (see ``run_sharded``)."""
    return run_sharded(items, lambda shard: [fn(item) for item in shard.items], shard_size=shard_size,
                       retries=retries)


def patching_sweeps(model: Any, pairs: Sequence[tuple[Any, Any]], *, shard_size: int = 4, retries: int = 2,
                    **kwargs: Any) -> list:
    """``hooks.patching_sweep(model, clean, corrupt, **kwargs)`` for every ``(clean, corrupt)`` pair, over the ranks:
    the PatchingResults in the pairs' order."""
    from workbench.hooks import patching_sweep

    bad = [i for i, pair in enumerate(pairs) if not (isinstance(pair, (tuple, list)) and len(pair) == 2)]
    if bad:
        raise WorkbenchError(f"pair {bad[0]} is not a (clean, corrupt) pair")
    kwargs.setdefault("progress", False)
    return sweep(pairs, lambda pair: patching_sweep(model, pair[0], pair[1], **kwargs), shard_size=shard_size,
                 retries=retries)


def _shard_activations(model: Any, prompts: list, names: list[str], reduce: str | int | None,
                       batch_size: int | None) -> dict[str, torch.Tensor]:
    """One shard's activations: ``{hook: [rows, ...]}`` (one row per prompt with ``reduce``, else every token) and
    ``"offsets"`` ``[prompts + 1]``, where prompt ``i``'s rows start."""
    traces = model.run_batch(prompts, record=names, reduce=reduce, logits=None, batch_size=batch_size)
    join = torch.cat if reduce is None else torch.stack
    out = {name: join([t.activations[name] for t in traces]) for name in names}
    rows = [1 if reduce is not None else len(t.ids) for t in traces]
    out["offsets"] = torch.tensor([0, *rows], dtype=torch.long).cumsum(0)
    return out


def harvest(model: Any, prompts: Sequence[str | Sequence[int]], hooks: Sequence[str], *,
            reduce: str | int | None = "last", out: str | Path | None = None, shard_size: int = 64,
            batch_size: int | None = None, retries: int = 2) -> dict[str, torch.Tensor] | Path:
    """Activations of ``hooks`` (names or globs) over ``prompts``, the prompts sharded over the ranks.

    In memory (``out`` None): ``{hook: [len(prompts), ...]}``, one row per prompt reduced by ``reduce`` ("last",
    "mean" or a position), on every rank. With ``out``, a folder of safetensors shards for SAE training or probes:
    ``shard-00000.safetensors`` ... with ``{hook: [rows, ...], "offsets": [prompts + 1]}`` (rows are prompts with
    ``reduce``, every token with ``reduce=None``) and ``manifest.json`` listing them in order; each shard is written
    once, atomically, and a rerun (``torchrun --max-restarts``) keeps the shards already written. Returns the
    manifest's path."""
    from workbench.hooks import Recorder
    from workbench.hooks.batching import check_reduce
    from workbench.hooks.points import axes
    from workbench.model import check_batch_size

    check_batch_size(batch_size)
    if out is None and reduce is None:
        raise WorkbenchError("harvesting every token needs out=FOLDER (safetensors shards); in memory, give reduce")
    recorder = Recorder.for_patterns(hooks, model.config)
    if recorder is None:
        raise WorkbenchError("name at least one hook point to harvest")
    names = recorder.names
    grown = [name for name in names if axes(name).token != 0]
    if grown:
        raise WorkbenchError(f"{grown[0]} is not token-major ([heads, T, S]): harvest token-major hook points")
    ids = model.batch_ids(prompts)  # every prompt checked before any rank computes (a string is refused)
    check_reduce(reduce, names, [len(x) for x in ids])  # its type, and a position within every prompt
    if out is None:
        parts = _run_shards(ids, lambda shard: _shard_activations(model, shard.items, names, reduce, batch_size),
                            shard_size, retries)
        return {name: torch.cat([part[name] for part in parts]) for name in names}
    if isinstance(out, str) and not out.strip():
        raise WorkbenchError("out is an empty path: name the folder to write the shards into")
    folder = Path(out)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise WorkbenchError(f"{folder} is not a folder to write shards into")
    folder.mkdir(parents=True, exist_ok=True)
    # what computed the shards: the weights (their sha256, formats and merged adapters), dtype, numerics, device and
    # the interventions of enclosing hooks blocks (a function hook by its name)
    computed_by = [model.fingerprint(), str(model.dtype), model.current_numerics(), model.device.type,
                   model.hooks_block_specs()]

    def work(shard: Shard) -> list[int]:
        """Writes the shard's file (unless an earlier run of this same harvest wrote it) and gives each prompt's row
        count."""
        path = folder / f"shard-{shard.index:05d}.safetensors"
        # what the file holds: a rerun keeps it only when this matches (same computation, prompts, hooks and reduce)
        key = hashlib.sha256(json.dumps([computed_by, shard.items, names, reduce], default=str).encode()).hexdigest()
        offsets = _written_offsets(path, key)
        if offsets is None:
            from safetensors.torch import save

            tensors = _shard_activations(model, shard.items, names, reduce, batch_size)
            _write_atomic(folder, path.name, save({name: t.contiguous() for name, t in tensors.items()},
                                                  metadata={"harvest": key}))
            offsets = tensors["offsets"]
        return offsets.diff().tolist()

    counts = run_sharded(ids, work, shard_size=shard_size, retries=retries)
    manifest = folder / "manifest.json"
    if this_rank().rank == 0:
        shards = []
        for index, start in enumerate(range(0, len(ids), shard_size)):
            stop = min(start + shard_size, len(ids))
            shards.append({"file": f"shard-{index:05d}.safetensors", "prompts": [start, stop],
                           "rows": sum(counts[start:stop])})
        meta = {"format": HARVEST_FORMAT, "hooks": names, "reduce": reduce, "n_prompts": len(ids),
                "model": {"name": model.config.name, "architecture": model.config.architecture,
                          "n_layers": model.config.n_layers, "d_model": model.config.d_model},
                "shards": shards}
        _write_atomic(folder, manifest.name, json.dumps(meta, indent=2).encode())
    if this_rank().world > 1:
        dist.barrier()  # the manifest exists on return, on every rank
    return manifest


def _write_atomic(folder: Path, name: str, data: bytes) -> None:
    """``folder/name`` replaced by ``data``, never written through a link planted in the folder."""
    with open_folder(folder) as fd:
        replace_file(fd, name, data)


def _written_offsets(path: Path, key: str) -> torch.Tensor | None:
    """The offsets of a shard file an earlier run of the same harvest (``key``) wrote, or None to (re)compute it."""
    if not path.is_file() or path.is_symlink():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("harvest") != key:
                return None
            return f.get_tensor("offsets")
    except Exception:  # noqa: BLE001 - an unreadable leftover is recomputed and replaced
        return None


def read_harvest(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every shard of a harvest folder joined in order: ``{hook: [rows, ...], "offsets": [prompts + 1]}``."""
    from safetensors.torch import load

    folder = Path(folder)
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise WorkbenchError(f"{folder} holds no harvest (no manifest.json)")
    meta = read_json(manifest)
    try:
        hooks, shards = meta["hooks"], meta["shards"]
        files = [shard["file"] for shard in shards]
    except (KeyError, TypeError) as err:  # fields missing or of other types
        raise WorkbenchError(f"{manifest} is no harvest manifest ({clip(str(err), 120)})") from None
    if meta.get("format") != HARVEST_FORMAT:
        raise WorkbenchError(f"{manifest} is not a workbench harvest (format {shorten(meta.get('format'))})")
    if not isinstance(hooks, list) or not hooks or not all(isinstance(hook, str) for hook in hooks):
        raise WorkbenchError(f"{manifest}: hooks must be a list of hook point names, got {shorten(hooks)}")
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in hooks}
    offsets, base = [torch.zeros(1, dtype=torch.long)], 0
    for name in files:
        path = folder / str(name)
        if path.is_symlink() or path.resolve().parent != folder.resolve() or not path.is_file():
            raise WorkbenchError(f"harvest shard {shorten(name)} is missing from {folder}")
        try:
            tensors = load(regular_file(path).read_bytes())
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types on a malformed file
            raise WorkbenchError(f"harvest shard {path} cannot be read: {clip(str(err), 120)}") from None
        missing = [key for key in (*parts, "offsets") if key not in tensors]
        if missing:
            raise WorkbenchError(f"harvest shard {path} holds no {shorten(missing[0])}")
        _check_shard(tensors, parts, path)
        for hook in parts:
            parts[hook].append(tensors[hook])
        offsets.append(tensors["offsets"][1:] + base)
        base += int(tensors["offsets"][-1])
    return {**{name: torch.cat(chunks) for name, chunks in parts.items()}, "offsets": torch.cat(offsets)}


def _check_shard(tensors: dict[str, torch.Tensor], parts: dict[str, list[torch.Tensor]], path: Path) -> None:
    """A shard's offsets count up from 0 to the rows of each of its hooks, whose rows are as wide as earlier shards'."""
    offsets = tensors["offsets"]
    if (offsets.dim() != 1 or len(offsets) < 1 or offsets.dtype != torch.long or int(offsets[0]) != 0
            or bool((offsets.diff() < 0).any())):
        raise WorkbenchError(f"harvest shard {path}: its offsets do not count rows up from 0")
    for hook, chunks in parts.items():
        rows = tensors[hook]
        if rows.dim() < 1 or rows.shape[0] != int(offsets[-1]):
            raise WorkbenchError(f"harvest shard {path}: {hook} has {rows.shape[0] if rows.dim() else 'no'} rows "
                                 f"where its offsets end at {int(offsets[-1])}")
        if chunks and (rows.shape[1:] != chunks[0].shape[1:] or rows.dtype != chunks[0].dtype):
            raise WorkbenchError(f"harvest shard {path}: {hook} is {rows.dtype} {tuple(rows.shape[1:])} a row, "
                                 f"unlike earlier shards' {chunks[0].dtype} {tuple(chunks[0].shape[1:])}")


def collect_activations(model: Any, prompts: Sequence[str], hook_names: Sequence[str], pooling: str = "last", *,
                        shard_size: int = 64, retries: int = 2) -> dict[str, torch.Tensor]:
    """``probes.collect_activations`` with the prompts sharded over the ranks: pooled ``{hook: [prompts, features]}``
    for ``probes.fit_probe`` (a probe dataset)."""
    from workbench.probes.activations import POOLINGS, check_prompts

    prompts = check_prompts(prompts)
    if pooling not in POOLINGS:
        raise WorkbenchError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    acts = harvest(model, prompts, hook_names, reduce=pooling, shard_size=shard_size, retries=retries)
    return {name: value.flatten(1) for name, value in acts.items()}
