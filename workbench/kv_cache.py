"""The key/value cache, with the surgery operations interpretability work needs."""
from __future__ import annotations

from typing import Sequence

import torch

from workbench.errors import WorkbenchError


class KVCache:
    """Rotated keys and values of every layer for the tokens seen so far.

    Slots are ordered as the tokens were fed; each slot remembers the rope position its key was rotated
    with. Surgery never re-rotates: after deleting slots, the kept keys keep their positions and the next
    token is placed one after the last kept slot's position.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, d_head: int, dtype: torch.dtype, device: torch.device | str,
                 capacity: int = 64):
        self.n_layers, self.n_kv_heads, self.d_head = n_layers, n_kv_heads, d_head
        self.dtype, self.device = dtype, torch.device(device)
        self._keys = [torch.zeros(n_kv_heads, capacity, d_head, dtype=dtype, device=device) for _ in range(n_layers)]
        self._values = [torch.zeros_like(k) for k in self._keys]
        self._positions = torch.zeros(capacity, dtype=torch.long)
        self._tokens: list[int] = []
        self.length = 0

    # ----------------------------------------------------------------------------- used by the runner

    @property
    def capacity(self) -> int:
        return self._positions.shape[0]

    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` more slots (amortized doubling)."""
        needed = self.length + n_new
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        for store in (self._keys, self._values):
            for i, old in enumerate(store):
                grown = torch.zeros(self.n_kv_heads, capacity, self.d_head, dtype=self.dtype, device=self.device)
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

    def commit(self, positions: torch.Tensor, tokens: Sequence[int]) -> None:
        """Make the slots written by a finished forward part of the cache."""
        n = positions.shape[0]
        self._positions[self.length : self.length + n] = positions.cpu()
        self._tokens.extend(int(t) for t in tokens)
        self.length += n

    @property
    def next_position(self) -> int:
        return int(self._positions[self.length - 1]) + 1 if self.length else 0

    # ------------------------------------------------------------------------------------- inspection

    @property
    def positions(self) -> torch.Tensor:
        return self._positions[: self.length].clone()

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one layer's keys and values, ``[n_kv_heads, length, d_head]`` each."""
        self._check_layer(layer)
        return self._keys[layer][:, : self.length].clone(), self._values[layer][:, : self.length].clone()

    # ---------------------------------------------------------------------------------------- surgery

    def set(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._check_layer(layer)
        expected = (self.n_kv_heads, self.length, self.d_head)
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != expected:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise WorkbenchError(f"kv set: {name} must have shape {expected}, got {shape}")
            if not torch.isfinite(t).all():
                raise WorkbenchError(f"kv set: {name} contain NaN or Inf")
        self._keys[layer][:, : self.length] = keys.to(self.device, self.dtype)
        self._values[layer][:, : self.length] = values.to(self.device, self.dtype)

    def clear(self, layer: int) -> None:
        """Zero one layer's keys and values: its attention then sees no content in the cached slots."""
        self._check_layer(layer)
        self._keys[layer].zero_()
        self._values[layer].zero_()

    def copy_layer_from(self, other: "KVCache", layer: int) -> None:
        """Take one layer's keys and values from another cache of the same length."""
        if other.length != self.length:
            raise WorkbenchError(f"kv copy: source cache has {other.length} slots, this one {self.length}")
        self.set(layer, *other.get(layer))

    def clone(self) -> "KVCache":
        return self.select(torch.arange(self.length))

    def clone_positions(self, start: int, stop: int) -> "KVCache":
        """A new cache holding slots ``start:stop`` (their rope positions kept)."""
        if not 0 <= start <= stop <= self.length:
            raise WorkbenchError(f"kv clone: slot range {start}:{stop} outside 0:{self.length}")
        return self.select(torch.arange(start, stop))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` slots (generation then continues from there)."""
        if not 0 <= length <= self.length:
            raise WorkbenchError(f"kv truncate: length {length} outside 0..{self.length}")
        self.length = length
        del self._tokens[length:]

    def delete_positions(self, slots: Sequence[int]) -> None:
        """Remove slots (indices into the cache); kept keys stay rotated at their original positions."""
        doomed = set()
        for s in slots:
            if not -self.length <= int(s) < self.length:
                raise WorkbenchError(f"kv delete: slot {s} outside 0..{self.length - 1}")
            doomed.add(int(s) % self.length)
        keep = torch.tensor([i for i in range(self.length) if i not in doomed], dtype=torch.long)
        kept = self.select(keep)
        self.__dict__.update(kept.__dict__)

    def select(self, slots: torch.Tensor) -> "KVCache":
        """A new cache made of the given slots, in the given order."""
        out = KVCache(self.n_layers, self.n_kv_heads, self.d_head, self.dtype, self.device, max(len(slots), 1))
        idx = slots.to(self.device)
        for layer in range(self.n_layers):
            out._keys[layer][:, : len(slots)] = self._keys[layer][:, idx]
            out._values[layer][:, : len(slots)] = self._values[layer][:, idx]
        out._positions[: len(slots)] = self._positions[slots]
        out._tokens = [self._tokens[i] for i in slots.tolist()]
        out.length = len(slots)
        return out

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise WorkbenchError(f"kv: layer {layer!r} outside 0..{self.n_layers - 1}")

    def __repr__(self) -> str:
        return f"KVCache(layers={self.n_layers}, length={self.length}, next_position={self.next_position})"
