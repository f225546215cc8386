"""The key/value cache, with the surgery operations interpretability work needs."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence, Union

import numpy as np
import torch

from workbench.errors import WorkbenchError, integer, integer_list, shorten


# one device for every layer, or one per layer
Devices = Union[torch.device, str, Sequence[Union[torch.device, str]]]


def layer_devices(device: Devices, n_layers: int) -> list[torch.device]:
    """One device per layer: ``device`` for all, or the list given (a model split over devices)."""
    if isinstance(device, (str, torch.device)):
        return [torch.device(device)] * n_layers
    devices = [torch.device(d) for d in device]
    if len(devices) != n_layers:
        raise WorkbenchError(f"a cache of {n_layers} layers needs one device per layer, got {len(devices)}")
    return devices


def layer_shapes(n_layers: int, n_kv_heads: int | Sequence[int], d_head: int | Sequence[int]
                 ) -> list[tuple[int, int]]:
    """Each layer's ``(n_kv_heads, d_head)``: one pair for all, or per layer where layers differ (Gemma 4's global
    layers)."""
    heads = [n_kv_heads] * n_layers if isinstance(n_kv_heads, int) else list(n_kv_heads)
    dims = [d_head] * n_layers if isinstance(d_head, int) else list(d_head)
    return list(zip(heads, dims))


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``x`` on ``device``; from the host to a GPU through pinned memory without waiting: a plain copy makes the host
    wait for all the work queued on the device (a forward's index tensors would make it wait mid-forward)."""
    if x.device.type != "cpu" or torch.device(device).type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _kv_sources(kv_sources: Sequence[int] | None, n_layers: int) -> tuple[int, ...]:
    return tuple(range(n_layers)) if kv_sources is None else tuple(int(i) for i in kv_sources)


def _is_index(value: object) -> bool:
    """Whether ``value`` is one integer (a numpy array of several is not)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _left_out(n_rows: int, h: int, capacity: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """The store of a layer ``BatchKVCache.from_prefixes`` did not copy: one zero slot seen everywhere, which takes no
    memory and which a write fails on (a forward that starts past the layer never reads or writes it)."""
    return like.new_zeros(1, h, 1, d).expand(n_rows, h, capacity, d)


def _is_left_out(store: torch.Tensor) -> bool:
    """Whether ``store`` is a layer's ``_left_out`` view rather than memory of its own."""
    return not store.is_contiguous()


def next_position_after(positions: torch.Tensor) -> int:
    """The rope position a sequence continues at after slots at ``positions`` (kept slots keep theirs after surgery)."""
    return int(positions.max()) + 1 if positions.numel() else 0


def causal_mask(n_new: int, n_slots: int, device: torch.device | str) -> torch.Tensor | None:
    """True where new token i (the last ``n_new`` of ``n_slots``) may not attend: slots after its own. None for one
    new token, which sees every slot: a decode step then masks nothing (and calls no op to do it)."""
    if n_new == 1:
        return None
    return torch.ones(n_new, n_slots, dtype=torch.bool, device=device).triu(n_slots - n_new + 1)


# Fewest tokens a group of rows sharing a prefix must save (the prefix's length times the rows after the first) for
# the prefix to be computed once, and the least share of a forward's tokens all its groups must save: the prefixes'
# own forward reads every weight once more (on 2 CPU threads about what 30 tokens of a batch cost), and each grouped
# row copies its prefix's keys and values.
MIN_SHARED_TOKENS = 16
MIN_SHARED_FRACTION = 0.1


@dataclass(frozen=True)
class PrefixGroup:
    """Rows of a batched forward (indices into its rows) that start with the same ``length`` tokens."""
    length: int
    rows: tuple[int, ...]


def prefix_groups(rows: Sequence[Sequence[int]]) -> list[PrefixGroup]:
    """Groups of rows whose shared leading tokens are worth computing once (a few-shot template, a system prompt, the
    common start of a contrastive pair, a repeated prompt), as a server's prefix cache shares them across requests:
    of the rows in token order, the runs that save the most tokens in all (a run's saving: the tokens all its rows
    share, times its rows after the first, when that reaches ``MIN_SHARED_TOKENS``), or none when they save less than
    ``MIN_SHARED_FRACTION`` of the rows' tokens. Each row keeps at least one token of its own, whose logits its forward
    gives."""
    order = sorted(range(len(rows)), key=lambda i: list(rows[i]))
    # shared[k]: the tokens sorted rows k - 1 and k share, each keeping one of its own
    shared = np.array([0] + [min(common_length(rows[a], rows[b]), len(rows[a]) - 1, len(rows[b]) - 1)
                             for a, b in zip(order, order[1:])], dtype=np.int64)
    best = np.zeros(len(order) + 1, dtype=np.int64)  # best[j]: the most the first j sorted rows save
    first = list(range(len(order) + 1))  # first[j]: where the last run of that best starts
    for j in range(2, len(order) + 1):  # the last run is sorted rows first[j] .. j - 1
        length = np.minimum.accumulate(shared[j - 1:0:-1])  # the run's shared tokens, starting at j - 2, j - 3, .., 0
        saving = length * np.arange(1, j)
        saving[saving < MIN_SHARED_TOKENS] = 0
        gains = best[j - 2::-1] + saving
        k = int(gains.argmax())
        best[j], first[j] = (gains[k], j - 2 - k) if gains[k] > best[j - 1] else (best[j - 1], j - 1)
    if best[-1] < MIN_SHARED_FRACTION * sum(map(len, rows)):
        return []
    groups, j = [], len(order)
    while j > 0:
        i = first[j]
        if j - i > 1:
            groups.append(PrefixGroup(int(shared[i + 1:j].min()), tuple(order[i:j])))
        j = i if j - i > 1 else j - 1
    return groups[::-1]


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class KVCache:
    """Rotated keys and values of every layer for the tokens seen so far.

    Slots are ordered as the tokens were fed; each slot remembers the rope position its key was rotated
    with. Surgery never re-rotates: after deleting slots, the kept keys keep their positions, and the next
    token is placed one after the largest kept position (the last slot's, unless ``select`` reordered them).
    A new token attends to every slot in the cache.

    So ``delete_positions`` is not a run on the prompt without those tokens: the kept keys and values were
    computed while the deleted tokens were present, and rope sees the gaps. When the last slot is kept, it
    equals, up to float rounding, a full forward over the whole prompt plus the new tokens in which the
    new tokens' attention scores to the deleted slots are set to -inf (tests/test_kv_cache.py checks
    exactly that). Deleting trailing slots is ``truncate``: the next token then takes the position after
    the last kept one, which equals a run on the shorter prompt.
    """

    def __init__(self, n_layers: int, n_kv_heads: int | Sequence[int], d_head: int | Sequence[int],
                 dtype: torch.dtype, device: Devices, capacity: int = 64, kv_sources: Sequence[int] | None = None):
        """``device``: one for every layer, or one per layer (a split model's: each layer's keys and values live
        where it runs; positions and masks are made on the first). ``n_kv_heads`` and ``d_head``: one for every
        layer, or one per layer. ``kv_sources``: the layer whose keys and values each layer attends over
        (``ModelConfig.kv_source``; None: its own)."""
        self.n_layers, self.n_kv_heads, self.d_head = n_layers, n_kv_heads, d_head
        self.kv_sources = _kv_sources(kv_sources, n_layers)
        self.devices = layer_devices(device, n_layers)
        self.dtype, self.device = dtype, self.devices[0]
        self._keys = [torch.zeros(h, capacity, d, dtype=dtype, device=device)
                      for (h, d), device in zip(layer_shapes(n_layers, n_kv_heads, d_head), self.devices)]
        self._values = [torch.zeros_like(k) for k in self._keys]
        self._positions = torch.zeros(capacity, dtype=torch.long)
        self._tokens: list[int] = []
        self.length = 0
        self._next = 0  # next_position, kept on the host: a decode step reads it without a reduction
        self._pending = 0  # the first position of the forward between prepare and commit

    # ----------------------------------------------------------------------------- used by the runner

    @property
    def capacity(self) -> int:
        return self._positions.shape[0]

    @property
    def nbytes(self) -> int:
        """Memory the keys and values take (every slot of the capacity)."""
        return sum(t.numel() * t.element_size() for t in (*self._keys, *self._values))

    def layer_shape(self, layer: int) -> tuple[int, int]:
        """``(n_kv_heads, d_head)`` of one layer's keys and values."""
        layer = self._check_layer(layer)
        return self._keys[layer].shape[0], self._keys[layer].shape[2]

    def prepare(self, n_new: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Room for ``n_new`` tokens; their rope positions ``[T]`` and the slots each may not see ``[T, S]`` (None:
        every slot)."""
        self.reserve(n_new)
        start = self._pending = self._next
        positions = torch.arange(start, start + n_new, device=self.device)
        return positions, causal_mask(n_new, self.length + n_new, self.device)

    def slot_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The rope positions of every slot the new tokens (at ``positions``, after ``prepare``) attend over, ``[S]``:
        what a sliding window masks by."""
        return torch.cat((to_device(self._positions[: self.length], positions.device), positions))

    def capacity_for(self, n_new: int) -> int:
        """The capacity ``reserve(n_new)`` leaves: amortized doubling."""
        needed = self.length + n_new
        return self.capacity if needed <= self.capacity else max(needed, 2 * self.capacity)

    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` more slots."""
        capacity = self.capacity_for(n_new)
        if capacity == self.capacity:
            return
        for store in (self._keys, self._values):
            for i, old in enumerate(store):
                grown = old.new_zeros(old.shape[0], capacity, old.shape[2])
                grown[:, : self.length] = old[:, : self.length]
                store[i] = grown
        positions = torch.zeros(capacity, dtype=torch.long)
        positions[: self.length] = self._positions[: self.length]
        self._positions = positions

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' ``[n_kv, T, d_head]`` keys/values after the committed slots; return all of them."""
        stop = self.length + keys.shape[1]
        self._keys[layer][:, self.length : stop] = keys
        self._values[layer][:, self.length : stop] = values
        return self._keys[layer][:, :stop], self._values[layer][:, :stop]

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """One layer's key and value buffers ``[n_kv_heads, capacity, d_head]`` and the slot the forward's new tokens
        start at, for an op that writes them there itself as ``write`` does (``layer_ops.rope_attention``); None where
        the cache writes its own way."""
        return self._keys[layer], self._values[layer], self.length

    def commit(self, tokens: torch.Tensor) -> None:
        """Make the slots written by a finished forward (of ``tokens``, best on the host) part of the cache, at the
        positions ``prepare`` gave them (known on the host: no read back from the device)."""
        n, start = tokens.shape[0], self._pending
        torch.arange(start, start + n, out=self._positions[self.length : self.length + n])
        self._tokens.extend(tokens.tolist())
        self.length += n
        self._next = start + n

    @property
    def next_position(self) -> int:
        return self._next

    def _recount(self) -> None:
        """``next_position`` from the slots kept (after surgery)."""
        self._next = next_position_after(self._positions[: self.length])

    # ------------------------------------------------------------------------------------- inspection

    @property
    def positions(self) -> torch.Tensor:
        return self._positions[: self.length].clone()

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one layer's keys and values, ``[n_kv_heads, length, d_head]`` each."""
        layer = self._check_own_layer(layer, "get", "read")
        return self._keys[layer][:, : self.length].clone(), self._values[layer][:, : self.length].clone()

    # ---------------------------------------------------------------------------------------- surgery

    def set(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace one layer's keys (already rotated) and values, ``[n_kv_heads, length, d_head]`` each."""
        layer = self._check_own_layer(layer, "set")
        n_kv_heads, d_head = self.layer_shape(layer)
        expected = (n_kv_heads, self.length, d_head)
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != expected:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise WorkbenchError(f"kv set: {name} must have shape {expected}, got {shape}")
            if not t.is_floating_point():
                raise WorkbenchError(f"kv set: {name} must be floating point, got {t.dtype}")
            if not torch.isfinite(t).all():
                raise WorkbenchError(f"kv set: {name} contain NaN or Inf")
        self._keys[layer][:, : self.length] = keys.to(self.devices[layer], self.dtype)
        self._values[layer][:, : self.length] = values.to(self.devices[layer], self.dtype)

    def clear(self, layer: int) -> None:
        """Zero one layer's keys and values. New tokens then score 0 against every cached slot there, so
        those slots still take a share of the softmax but contribute zero values."""
        layer = self._check_own_layer(layer, "clear")
        self._keys[layer].zero_()
        self._values[layer].zero_()

    def copy_layer_from(self, other: "KVCache", layer: int) -> None:
        """Take one layer's keys and values from another cache of the same length (keys keep the rotation
        they had there; positions are not compared)."""
        layer = self._check_own_layer(layer, "copy")
        check_cache(other, "kv copy")
        if other.length != self.length:
            raise WorkbenchError(f"kv copy: source cache has {other.length} slots, this one {self.length}")
        self.set(layer, *other.get(layer))

    def clone(self) -> "KVCache":
        return self.select(torch.arange(self.length))

    def clone_positions(self, start: int, stop: int) -> "KVCache":
        """A new cache holding slots ``start:stop`` (their rope positions kept)."""
        start, stop = integer(start, "kv clone: start"), integer(stop, "kv clone: stop")
        if not 0 <= start <= stop <= self.length:
            raise WorkbenchError(f"kv clone: slot range {start}:{stop} outside 0:{self.length}")
        return self.select(torch.arange(start, stop))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` slots (generation then continues from there)."""
        # checked before anything is assigned: a float length would leave the cache unusable
        length = integer(length, "kv truncate: length")
        if not 0 <= length <= self.length:
            raise WorkbenchError(f"kv truncate: length {length} outside 0..{self.length}")
        self.length = length
        del self._tokens[length:]
        self._recount()

    def delete_positions(self, slots: Sequence[int]) -> None:
        """Remove slots (indices into the cache, negative from the end); kept keys keep their positions."""
        doomed = {s % self.length for s in self._check_slots(slots, "kv delete")}
        keep = torch.tensor([i for i in range(self.length) if i not in doomed], dtype=torch.long)
        kept = self.select(keep)
        self.__dict__.update(kept.__dict__)

    def select(self, slots: Sequence[int] | torch.Tensor) -> "KVCache":
        """A new cache made of the given slots (indices into this cache), in the given order."""
        slots = torch.tensor(self._check_slots(slots, "kv select"), dtype=torch.long) % max(self.length, 1)
        out = KVCache(self.n_layers, self.n_kv_heads, self.d_head, self.dtype, self.devices, max(len(slots), 1),
                      self.kv_sources)
        for layer, device in enumerate(self.devices):
            idx = slots.to(device)
            out._keys[layer][:, : len(slots)] = self._keys[layer][:, idx]
            out._values[layer][:, : len(slots)] = self._values[layer][:, idx]
        out._positions[: len(slots)] = self._positions[slots]
        out._tokens = [self._tokens[i] for i in slots.tolist()]
        out.length = len(slots)
        out._recount()
        return out

    def _check_slots(self, slots: Sequence[int] | torch.Tensor, what: str) -> list[int]:
        if isinstance(slots, torch.Tensor):
            if slots.is_floating_point() or slots.dim() != 1:
                raise WorkbenchError(f"{what}: slots must be a 1-D list of integers")
            slots = slots.tolist()
        if _is_index(slots):
            raise WorkbenchError(f"{what}: slots must be a list of integers, got the single {slots!r} (pass [{slots}])")
        if not isinstance(slots, (str, bytes)):
            try:  # once: a generator read by the checks below would be empty by the time the slots are used
                slots = list(slots)
            except TypeError:
                raise WorkbenchError(f"{what}: slots must be a list of integers, got {shorten(slots)}") from None
        if isinstance(slots, (str, bytes)) or any(isinstance(s, bool) or not hasattr(s, "__index__")
                                                    for s in slots):
            raise WorkbenchError(f"{what}: slots must be integers, got {slots!r}")
        bad = [int(s) for s in slots if not -self.length <= int(s) < self.length]
        if bad:
            raise WorkbenchError(f"{what}: slots {bad} outside 0..{self.length - 1} (or -{self.length}..-1 from the "
                                 "end)")
        return [int(s) for s in slots]

    def _check_layer(self, layer: int) -> int:
        """``layer`` as an int (a numpy integer too, never a bool) in 0..n_layers - 1, or a clear error."""
        index = integer(layer, "kv: layer")
        if not 0 <= index < self.n_layers:
            raise WorkbenchError(f"kv: layer {layer!r} outside 0..{self.n_layers - 1}")
        return index

    def _check_own_layer(self, layer: int, what: str, verb: str = "edit") -> int:
        """A layer that attends over an earlier layer's keys and values holds none of its own (its slots stay
        zero): surgery there would read zeros or change nothing."""
        layer = self._check_layer(layer)
        source = self.kv_sources[layer]
        if source != layer:
            raise WorkbenchError(f"kv {what}: layer {layer} reuses layer {source}'s keys and values: {verb} layer "
                                 f"{source}")
        return layer

    def __repr__(self) -> str:
        return f"KVCache(layers={self.n_layers}, length={self.length}, next_position={self.next_position})"


class StaticKVCache(KVCache):
    """A fixed-capacity cache whose length lives on the device, so a decode step can be captured once as a
    CUDA graph and replayed: every shape is static, new tokens attend over all slots with the unwritten
    ones masked. Slot i holds position i; generation uses it internally, surgery is for KVCache."""

    def __init__(self, n_layers: int, n_kv_heads: int | Sequence[int], d_head: int | Sequence[int],
                 dtype: torch.dtype, device: Devices, capacity: int, kv_sources: Sequence[int] | None = None):
        super().__init__(n_layers, n_kv_heads, d_head, dtype, device, capacity, kv_sources)
        self._length = torch.zeros((), dtype=torch.long, device=self.device)
        self._slots = torch.arange(capacity, device=self.device)

    def prepare(self, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self._length + torch.arange(n_new, device=self.device)
        return positions, self._slots[None, :] > positions[:, None]

    def slot_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return self._slots

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self._length + torch.arange(keys.shape[1], device=self.device)
        self._keys[layer].index_copy_(1, positions, keys)
        self._values[layer].index_copy_(1, positions, values)
        return self._keys[layer], self._values[layer]

    def buffers(self, layer: int) -> None:
        return None  # its new slots lie where the device-side length says

    def commit(self, tokens: torch.Tensor) -> None:
        self._length += tokens.shape[0]

    def rewind(self, length: torch.Tensor) -> None:
        """Set the device-side length back (after warm-up runs of a step about to be captured)."""
        self._length.copy_(length)

    def copy_from(self, other: "StaticKVCache") -> None:
        """Hold what ``other`` (of the same capacity) holds, in place: a built step's cache taking over from the cache
        of eager steps."""
        for mine, theirs in zip((*self._keys, *self._values), (*other._keys, *other._values)):
            mine.copy_(theirs)
        self._length.copy_(other._length)

    @property
    def device_length(self) -> torch.Tensor:
        return self._length


def check_cache(cache: Any, what: str) -> None:
    """A single-sequence cache, or an error naming ``what`` took something else."""
    if not isinstance(cache, KVCache):
        raise WorkbenchError(f"{what} takes a KVCache (model.new_cache()), got {type(cache).__name__}")


class BatchKVCache:
    """Keys and values of a batch of sequences, one row each with a length of its own.

    Row ``b`` holds its sequence's slots ``0 .. lengths[b] - 1`` in ``[B, n_kv_heads, capacity, d_head]`` stores; a
    batched forward (``Transformer.forward`` with a ``BatchLayout``) appends each row's new tokens after its own slots,
    and each row's tokens attend to that row alone. Surgery is per row: ``row(b)`` is a :class:`KVCache` copy to edit
    with every operation it has, and ``set_row(b, cache)`` puts one back. ``keep_rows`` drops finished sequences.
    """

    def __init__(self, n_rows: int, n_layers: int, n_kv_heads: int | Sequence[int], d_head: int | Sequence[int],
                 dtype: torch.dtype, device: Devices, capacity: int = 64, kv_sources: Sequence[int] | None = None):
        self.n_layers, self.n_kv_heads, self.d_head = n_layers, n_kv_heads, d_head
        self.kv_sources = _kv_sources(kv_sources, n_layers)  # as KVCache's: its rows' surgery refuses shared layers
        self.devices = layer_devices(device, n_layers)  # as KVCache's
        self.dtype, self.device = dtype, self.devices[0]
        self._keys = [torch.zeros((n_rows, h, capacity, d), dtype=dtype, device=device)
                      for (h, d), device in zip(layer_shapes(n_layers, n_kv_heads, d_head), self.devices)]
        self._values = [torch.zeros_like(k) for k in self._keys]
        self._positions = torch.zeros(n_rows, capacity, dtype=torch.long)
        self._tokens: list[list[int]] = [[] for _ in range(n_rows)]
        self.lengths = [0] * n_rows
        self._next = [0] * n_rows  # next_positions, kept on the host
        # the forward between prepare and commit: its layout, its packed positions (on the host), and where each new
        # token's keys go (each row's slots, [B, T_max], on the device; None where every row holds as many)
        self._pending = None
        self._pending_positions: list[int] = []
        self._write_slots: torch.Tensor | None = None

    @classmethod
    def from_caches(cls, caches: Sequence[KVCache], capacity: int = 0) -> "BatchKVCache":
        """One row per cache (copies), with room for ``capacity`` slots a row (at least the longest)."""
        if not caches:
            raise WorkbenchError("a batch cache needs at least one row")
        for cache in caches:
            check_cache(cache, "kv from_caches")
        first = caches[0]
        out = cls(len(caches), first.n_layers, first.n_kv_heads, first.d_head, first.dtype, first.devices,
                  max(capacity, max(c.length for c in caches), 1), first.kv_sources)
        for b, cache in enumerate(caches):
            out.set_row(b, cache)
        return out

    @classmethod
    def from_prefixes(cls, caches: KVCache | Sequence[KVCache], lengths: Sequence[int], capacity: int = 0,
                      layers: Sequence[int] | None = None) -> "BatchKVCache":
        """One row per entry of ``lengths``, row ``b`` holding the first ``lengths[b]`` slots of a sequence's cache:
        ``caches``, one for every row, or one a row (caches of one model). Runs that each continue a sequence from a
        point of their own (a patching sweep's cells, of one pair or of several), with room for ``capacity`` slots a
        row. Only ``layers`` (None: every one) are copied; the others read as zeros and take no memory, for a forward
        that starts past them (``start_at_layer``), which never reads them."""
        lengths = integer_list(lengths, "kv from_prefixes: prefix lengths")
        sources = [caches] * len(lengths) if isinstance(caches, KVCache) else list(caches)
        for cache in sources:
            check_cache(cache, "kv from_prefixes")
        if not lengths or len(sources) != len(lengths):
            raise WorkbenchError(f"kv from_prefixes: prefix lengths {list(lengths)} for {len(sources)} caches")
        for b, (cache, n) in enumerate(zip(sources, lengths)):
            if not 0 <= n <= cache.length:
                raise WorkbenchError(f"kv from_prefixes: prefix lengths {list(lengths)}: row {b}'s outside "
                                     f"0..{cache.length}")
        index: dict[int, int] = {}  # id(cache) -> its place among the distinct caches
        distinct: list[KVCache] = []
        for cache in sources:
            if id(cache) not in index:
                index[id(cache)] = len(distinct)
                distinct.append(cache)
        which = [index[id(c)] for c in sources]
        first = distinct[0]
        if any(c.kv_sources != first.kv_sources or c.dtype != first.dtype
               or [k.shape[::2] for k in c._keys] != [k.shape[::2] for k in first._keys] for c in distinct):
            raise WorkbenchError("kv from_prefixes: the caches are of different models")
        n_rows, longest = len(lengths), max(lengths)
        capacity = max(capacity, longest, 1)
        # no stores of its own yet (each is set below): zero slots cost nothing to make
        out = cls(n_rows, first.n_layers, first.n_kv_heads, first.d_head, first.dtype, first.devices, 0,
                  first.kv_sources)
        copied = set(range(first.n_layers) if layers is None else layers)
        for store, part in ((out._keys, "_keys"), (out._values, "_values")):
            for layer, src in enumerate(getattr(first, part)):
                h, d = src.shape[0], src.shape[2]
                if layer not in copied:
                    store[layer] = _left_out(n_rows, h, capacity, d, src)
                    continue
                # every row takes the longest prefix at once; a row's slots past its own length are masked, then
                # overwritten
                store[layer] = src.new_empty(n_rows, h, capacity, d)
                store[layer][:, :, longest:] = 0
                if len(distinct) == 1:
                    store[layer][:, :, :longest] = src[None, :, :longest]
                    continue
                prefixes = src.new_zeros(len(distinct), h, longest, d)
                for i, cache in enumerate(distinct):
                    n = min(longest, cache.length)
                    prefixes[i, :, :n] = getattr(cache, part)[layer][:, :n]
                store[layer][:, :, :longest] = prefixes[torch.tensor(which, device=src.device)]
        positions = torch.zeros(len(distinct), longest, dtype=torch.long)
        for i, cache in enumerate(distinct):
            n = min(longest, cache.length)
            positions[i, :n] = cache._positions[:n]
        out._positions = torch.zeros(n_rows, capacity, dtype=torch.long)
        out._positions[:, :longest] = positions[0] if len(distinct) == 1 else positions[which]
        out._tokens = [list(c._tokens[:n]) for c, n in zip(sources, lengths)]
        out.lengths = [int(n) for n in lengths]
        # each prefix's next position from a running maximum of its cache's, not a maximum a row (hundreds of rows)
        after = (positions.cummax(1).values + 1).tolist()
        out._next = [after[i][n - 1] if n else 0 for i, n in zip(which, out.lengths)]
        return out

    @property
    def n_rows(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self._positions.shape[1]

    @property
    def next_positions(self) -> list[int]:
        return list(self._next)

    # ----------------------------------------------------------------------------- used by the runner

    def prepare(self, layout) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for the layout's new tokens; their packed rope positions ``[N]`` and the slots each may not see,
        ``[B, 1, T_max, S]`` (``S`` = the longest row's slots after the write, padded writes included)."""
        if layout.size != self.n_rows or tuple(layout.cached) != tuple(self.lengths):
            raise WorkbenchError(f"the batch layout ({layout.size} rows holding {list(layout.cached)}) does not match "
                                 f"the cache ({self.n_rows} rows holding {self.lengths})")
        self.reserve(max(self.lengths) + layout.width)
        self._pending = layout
        self._pending_positions = layout.host_positions(self._next)
        # built on the host and sent without waiting (a blocking copy would make the host wait for the device)
        cached = torch.tensor(self.lengths)[:, None]
        steps = torch.arange(layout.width)
        self._write_slots = None if len(set(self.lengths)) == 1 else to_device(cached + steps, self.device)
        slots = torch.arange(max(self.lengths) + layout.width)
        blocked = slots > (cached + steps)[:, :, None]  # [B, T_max, S]
        positions = to_device(torch.tensor(self._pending_positions), self.device)
        return positions, to_device(blocked[:, None], self.device)

    def slot_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The rope positions of every row's slots up to the longest after the write, ``[B, S]``, the new tokens'
        (packed ``positions``, after ``prepare``) included; padding slots hold 0 (the mask hides them)."""
        layout = self._pending
        out = self._positions[:, : max(self.lengths) + layout.width].clone()
        out[self._new_slots(layout)] = torch.tensor(self._pending_positions)
        return out

    def _new_slots(self, layout) -> tuple[list[int], list[int]]:
        """(row, slot) of each packed new token of ``layout``: an index of the ``[B, capacity]`` positions."""
        rows = [b for b, n in enumerate(layout.lengths) for _ in range(n)]
        slots = [self.lengths[b] + j for b, n in enumerate(layout.lengths) for j in range(n)]
        return rows, slots

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` slots a row (amortized doubling)."""
        if slots <= self.capacity:
            return
        capacity = max(slots, 2 * self.capacity)
        longest = max(self.lengths)
        for store in (self._keys, self._values):
            for i, old in enumerate(store):
                if _is_left_out(old):  # still no memory of its own
                    store[i] = _left_out(self.n_rows, old.shape[1], capacity, old.shape[3], old)
                    continue
                grown = old.new_zeros(self.n_rows, old.shape[1], capacity, old.shape[3])
                grown[:, :, :longest] = old[:, :, :longest]
                store[i] = grown
        positions = torch.zeros(self.n_rows, capacity, dtype=torch.long)
        positions[:, :longest] = self._positions[:, :longest]
        self._positions = positions

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None:
        """One layer's key and value stores ``[B, n_kv_heads, capacity, d_head]`` and each row's first new slot, for an
        op that writes a forward's new tokens there itself as ``write`` does (``layer_ops.rope_attention``); None for a
        layer ``from_prefixes`` did not copy (it holds no memory of its own)."""
        keys, values = self._keys[layer], self._values[layer]
        return None if _is_left_out(keys) or _is_left_out(values) else (keys, values, tuple(self.lengths))

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new ``[B, n_kv, T_max, d_head]`` keys/values after each row's slots; return every row's slots
        up to the longest, ``[B, n_kv, S, d_head]`` (slots past a row's end hold padding, which the mask hides)."""
        width = keys.shape[2]
        stop = max(self.lengths) + width
        if self._write_slots is None:
            start = self.lengths[0]
            self._keys[layer][:, :, start:stop] = keys
            self._values[layer][:, :, start:stop] = values
        else:
            slots = self._write_slots
            slots = slots if slots.device == keys.device else slots.to(keys.device)  # a split model's later layers
            index = slots[:, None, :, None].expand_as(keys)
            self._keys[layer].scatter_(2, index, keys)
            self._values[layer].scatter_(2, index, values)
        return self._keys[layer][:, :, :stop], self._values[layer][:, :, :stop]

    def commit(self, tokens: torch.Tensor) -> None:
        """Make the slots written by a finished forward (of the packed ``tokens``, best on the host) part of the
        cache, at the positions ``prepare`` gave them (known on the host: no read back from the device)."""
        layout, self._pending, self._write_slots = self._pending, None, None
        self._positions[self._new_slots(layout)] = torch.tensor(self._pending_positions, dtype=torch.long)
        tokens = tokens.tolist()
        for b, (start, n) in enumerate(zip(layout.starts, layout.lengths)):
            self._tokens[b].extend(tokens[start:start + n])
            self.lengths[b] += n
            self._next[b] = self._pending_positions[start + n - 1] + 1 if n else self._next[b]

    # ---------------------------------------------------------------------------------------- per row

    def row(self, b: int) -> KVCache:
        """A copy of row ``b`` as a single-sequence cache."""
        b = self._check_row(b)
        n = self.lengths[b]
        out = KVCache(self.n_layers, self.n_kv_heads, self.d_head, self.dtype, self.devices, max(n, 1),
                      self.kv_sources)
        for layer in range(self.n_layers):
            out._keys[layer][:, :n] = self._keys[layer][b, :, :n]
            out._values[layer][:, :n] = self._values[layer][b, :, :n]
        out._positions[:n] = self._positions[b, :n]
        out._tokens = list(self._tokens[b])
        out.length = n
        out._next = self._next[b]
        return out

    def set_row(self, b: int, cache: KVCache) -> None:
        """Replace row ``b`` with (a copy of) a single-sequence cache of the same model."""
        b = self._check_row(b)
        check_cache(cache, "kv set_row")
        if ((cache.n_layers, cache.n_kv_heads, cache.d_head, cache.kv_sources)
                != (self.n_layers, self.n_kv_heads, self.d_head, self.kv_sources)):
            raise WorkbenchError("kv set_row: the cache belongs to a model of another shape")
        n = cache.length
        self.reserve(n)
        for layer in range(self.n_layers):
            self._keys[layer][b, :, :n] = cache._keys[layer][:, :n].to(self.devices[layer], self.dtype)
            self._values[layer][b, :, :n] = cache._values[layer][:, :n].to(self.devices[layer], self.dtype)
        self._positions[b, :n] = cache._positions[:n]
        self._tokens[b] = list(cache._tokens)
        self.lengths[b] = n
        self._next[b] = cache.next_position

    def spread(self, sources: Sequence[int | None], capacity: int = 0) -> "BatchKVCache":
        """A cache of one row per entry of ``sources``: a copy of this cache's row ``sources[b]``, or an empty row for
        None (prefixes computed once, each seeding the rows that start with it), with room for ``capacity`` slots a
        row."""
        sources = [None if b is None else self._check_row(b) for b in sources]
        longest = max((self.lengths[b] for b in sources if b is not None), default=0)
        out = BatchKVCache(len(sources), self.n_layers, self.n_kv_heads, self.d_head, self.dtype, self.devices,
                           max(capacity, longest, 1), self.kv_sources)
        index = torch.tensor([0 if b is None else b for b in sources], dtype=torch.long)
        # every row takes the longest source's slots at once; a row's slots past its own length are masked, then
        # overwritten
        for store, source in ((out._keys, self._keys), (out._values, self._values)):
            for layer, src in enumerate(source):
                store[layer][:, :, :longest] = src[index.to(src.device), :, :longest]
        out._positions[:, :longest] = self._positions[index, :longest]
        out._tokens = [[] if b is None else list(self._tokens[b]) for b in sources]
        out.lengths = [0 if b is None else self.lengths[b] for b in sources]
        out._next = [0 if b is None else self._next[b] for b in sources]
        return out

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order (finished sequences leave a generating batch)."""
        rows = [self._check_row(b) for b in integer_list(rows, "kv keep_rows: rows")]
        if len(set(rows)) < len(rows):
            raise WorkbenchError(f"kv: keep_rows keeps each row once, got {rows}")
        index = torch.tensor(rows, dtype=torch.long)
        # in place: each kept row moves down over the rows dropped before it, only its slots up to the longest kept
        # (a decode step drops finished rows from stores of every layer; copying whole stores cost more than the step)
        moved = next((j for j, b in enumerate(rows) if b != j), len(rows))
        longest = max((self.lengths[b] for b in rows[moved:]), default=0)
        for store in (self._keys, self._values):
            for layer, old in enumerate(store):
                if moved < len(rows) and not _is_left_out(old):
                    with torch.inference_mode(old.is_inference()):  # a store a generation's prefill made
                        old[moved:len(rows), :, :longest] = old[index[moved:].to(old.device), :, :longest]
                store[layer] = old[:len(rows)]
        self._positions = self._positions[index]
        self._tokens = [self._tokens[b] for b in rows]
        self.lengths = [self.lengths[b] for b in rows]
        self._next = [self._next[b] for b in rows]

    def tokens(self, b: int) -> list[int]:
        return list(self._tokens[self._check_row(b)])

    def _check_row(self, b: Any) -> int:
        """Row ``b`` as an int (numpy's too), or an error naming the rows there are."""
        b = integer(b, "kv: a row")
        if not 0 <= b < self.n_rows:
            raise WorkbenchError(f"kv: row {b} outside 0..{self.n_rows - 1}")
        return b

    def __repr__(self) -> str:
        return f"BatchKVCache(rows={self.n_rows}, layers={self.n_layers}, lengths={self.lengths})"


class StaticBatchKVCache:
    """A batch's keys and values for decoding one token per row at a time with every shape fixed and each row's length
    on the device, so that a batched decode step can be captured once as a CUDA graph and replayed (``StaticKVCache``
    for a batch). Row ``b``'s new token takes slot ``lengths[b]`` at rope position ``lengths[b]`` and attends over every
    slot of its row, those past its own masked; the attention mask, rope positions and write slots are computed on the
    device from the lengths. It continues a ``BatchKVCache`` whose rows hold positions ``0 .. length - 1`` (a fresh
    prefill), taking over its memory (no copy): generation uses it internally, surgery is for ``BatchKVCache``.

    A row that stopped may keep being fed: its length grows past its sequence's end, and its slots are read by no
    other row (each row attends to its own alone)."""

    def __init__(self, cache: BatchKVCache):
        if cache.next_positions != cache.lengths or len(set(cache.devices)) != 1:
            raise WorkbenchError("a static batch cache continues rows that hold positions 0 .. length - 1, on one "
                                 "device")
        self.n_layers, self.n_kv_heads, self.d_head = cache.n_layers, cache.n_kv_heads, cache.d_head
        self.dtype, self.device, self.devices = cache.dtype, cache.device, cache.devices
        self._keys, self._values = list(cache._keys), list(cache._values)
        self.n_rows, self.capacity = cache.n_rows, cache.capacity
        self._lengths = torch.tensor(cache.lengths, dtype=torch.long).to(self.device)
        self._slots = torch.arange(self.capacity, device=self.device)
        self._write_index: torch.Tensor | None = None  # each row's slot for the forward between prepare and commit

    def prepare(self, layout) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' rope positions ``[B]`` (one new token each) and the slots each may not see, ``[B, 1, 1,
        capacity]``: those past its own."""
        if layout.lengths != (1,) * self.n_rows:
            raise WorkbenchError(f"a static batch cache takes one new token for each of its {self.n_rows} rows, not "
                                 f"{list(layout.lengths)}")
        positions = self._lengths.clone()  # its own tensor: commit moves the lengths on
        self._write_index = positions.view(-1, 1, 1, 1)
        return positions, (self._slots[None, :] > positions[:, None])[:, None, None, :]

    def slot_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Every row's slots' rope positions ``[B, capacity]``: slot i holds position i."""
        return self._slots.expand(self.n_rows, -1)

    def buffers(self, layer: int) -> None:
        return None  # its new slots lie where the device-side lengths say

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store each row's new ``[B, n_kv, 1, d_head]`` key/value at its length; return every slot of every row."""
        index = self._write_index.expand_as(keys)
        self._keys[layer].scatter_(2, index, keys)
        self._values[layer].scatter_(2, index, values)
        return self._keys[layer], self._values[layer]

    def commit(self, tokens: torch.Tensor) -> None:
        self._lengths += 1
        self._write_index = None

    def rewind(self, lengths: torch.Tensor) -> None:
        """Set the device-side lengths back (after warm-up runs of a step about to be captured)."""
        self._lengths.copy_(lengths)

    @property
    def device_length(self) -> torch.Tensor:
        """The rows' lengths ``[B]``, on the device (``StaticKVCache.device_length`` for each row)."""
        return self._lengths

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._keys, *self._values))

    def __repr__(self) -> str:
        return f"StaticBatchKVCache(rows={self.n_rows}, layers={self.n_layers}, capacity={self.capacity})"
