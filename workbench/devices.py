"""Which device each layer runs on: a model split in contiguous layer ranges over several devices, sized by memory.

The embedding goes with the first layer, the final norm and the unembedding with the last; the forward hands the
residual stream from one range to the next (``workbench.runner``). A list of CPU devices (``["cpu", "cpu"]``) runs the
same code on one machine, which is how the tests check it without a GPU.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Sequence

import torch

from workbench.errors import WorkbenchError
from workbench.weights import ModelWeights

# Share of a device's free memory the weights may take: the rest is for activations and KV caches.
WEIGHT_SHARE = 0.9


def check_device(name: str | torch.device) -> torch.device:
    """A device that exists here (``cuda`` is the current CUDA device), or a clear error."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise WorkbenchError(f"unknown device {name!r}: {err}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise WorkbenchError(f"device {str(device)!r} asked for, but no CUDA device is available")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= count:
            raise WorkbenchError(f"device {str(device)!r} does not exist: this machine has {count} CUDA "
                                 f"device{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1})")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise WorkbenchError(f"device {str(device)!r} is not supported: use cpu or cuda[:N]")
    return device


def available_memory() -> int:
    """Bytes of memory available to this process (Linux), or 8 GiB where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def free_memory(device: torch.device) -> int:
    """Free bytes on a device (for the CPU: the memory available to this process)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()


def layer_bytes(weights: ModelWeights) -> list[int]:
    """Packed bytes of each layer's weights (matrices as stored, norm and bias vectors as float32)."""
    sizes = []
    for layer in weights.layers:
        size = 0
        for f in fields(layer):
            value = getattr(layer, f.name)
            if f.name in ("wqkv", "w_gate_up") or value is None:
                continue  # stacked matrices share their parts' bytes
            size += value.nbytes if not isinstance(value, torch.Tensor) else value.numel() * 4
        sizes.append(size)
    return sizes


def split_layers(weights: ModelWeights, devices: Sequence[str | torch.device], split: Sequence[int] | None = None,
                 free: Sequence[int] | None = None) -> list[int]:
    """How many layers each device holds: contiguous ranges in the order of ``devices``. ``split`` gives the counts;
    by default each device's share of the weights is in proportion to its free memory (``free``: bytes per device,
    measured when None), so every device fills to about the same fraction. The embedding counts on the first device,
    the final norm and the unembedding (a copy of a tied embedding) on the last. A split that puts more than
    ``WEIGHT_SHARE`` of a device's free memory in weights is an error that says how much is missing."""
    devices = check_devices(devices)
    n_layers, n_devices = len(weights.layers), len(devices)
    if n_devices > n_layers:
        raise WorkbenchError(f"{n_devices} devices for a model of {n_layers} layers: give at most one per layer")
    if free is None:  # a device named more than once (["cpu", "cpu"]) shares its memory
        free = [free_memory(d) // devices.count(d) for d in devices]
    capacity = [int(f * WEIGHT_SHARE) for f in free]
    sizes = layer_bytes(weights)
    head, tail = weights.embed.nbytes, weights.unembed.nbytes + weights.final_norm.numel() * 4
    total = head + sum(sizes) + tail
    if split is None:
        split = _proportional(sizes, head, total, capacity)
    elif (isinstance(split, (str, bytes)) or len(split) != n_devices
          or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split) or sum(split) != n_layers):
        raise WorkbenchError(f"split must give each of the {n_devices} devices at least one layer, {n_layers} in all; "
                             f"got {split!r}")
    load = [head * (k == 0) + tail * (k == n_devices - 1) for k in range(n_devices)]
    start = 0
    for k, count in enumerate(split):
        load[k] += sum(sizes[start:start + count])
        start += count
    over = [k for k in range(n_devices) if load[k] > capacity[k]]
    if over:
        k, gib = over[0], 1 << 30
        raise WorkbenchError(
            f"the model does not fit: {devices[k]} would hold {load[k] / gib:.2f} GiB of weights and has "
            f"{free[k] / gib:.2f} GiB free ({WEIGHT_SHARE:.0%} of it for weights); the {n_devices} devices together "
            f"have {sum(capacity) / gib:.2f} GiB for {total / gib:.2f} GiB: add devices or load a smaller format")
    return list(split)


def _proportional(sizes: list[int], head: int, total: int, capacity: list[int]) -> list[int]:
    """Layers per device such that device k's range ends near its share of the capacity: layer i goes to the first
    device whose cumulative share holds the middle of the layer's bytes, every device keeping at least one layer."""
    n_layers, n_devices = len(sizes), len(capacity)
    bounds = [sum(capacity[: k + 1]) / sum(capacity) * total for k in range(n_devices)]
    counts, k, used = [0] * n_devices, 0, head
    for i, size in enumerate(sizes):
        middle = used + size / 2
        wanted = next((j for j, bound in enumerate(bounds) if middle <= bound), n_devices - 1)
        # contiguous, one device at a time, and enough layers left for every later device
        k = 0 if i == 0 else max(k, min(wanted, k + 1), n_devices - n_layers + i)
        counts[k] += 1
        used += size
    return counts


def check_devices(devices: Sequence[str | torch.device]) -> list[torch.device]:
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence) or not devices:
        raise WorkbenchError(f"devices must be a non-empty list, such as ['cuda:0', 'cuda:1'], got {devices!r}")
    return [check_device(d) for d in devices]
