"""Sampling and the decode loop over the runner's KV cache."""
from __future__ import annotations

import functools
import operator
import threading
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch
import torch.nn.functional as F

from workbench.errors import WorkbenchError, integer, real_number, seed as checked_seed, shorten
from workbench.kernels import layer_ops
from workbench.kernels.linear import Numerics, get_numerics, numerics
from workbench.kv_cache import KVCache, StaticBatchKVCache, StaticKVCache, prefix_groups
from workbench.moe import by_pair_supported
from workbench.runner import BatchLayout, Hooks, Lora, LoraRows, Transformer, capturable, edits_only


# The smallest temperature above 0 (greedy): logits / temperature stays far inside float32's range (|logits| would have
# to pass 3e32 to overflow), where a smaller one overflows to inf and the softmax to NaN.
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; otherwise softmax(logits / temperature) cut to top_k and top_p, seeded.

    Every field is checked here, so a generation refuses a bad value before its prefill touches a cache:
    ``temperature`` 0 or a real number in [MIN_TEMPERATURE, inf] (inf samples uniformly), ``top_k`` an integer >= 0
    (0: no cut), ``top_p`` in (0, 1], ``seed`` None (a fresh one) or an integer in torch's seed range
    (``errors.SEED_RANGE``)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        temperature = real_number(self.temperature, "temperature", finite=False)
        if not temperature >= 0:  # NaN too
            raise WorkbenchError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < temperature < MIN_TEMPERATURE:
            raise WorkbenchError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature}")
        top_k = integer(self.top_k, "top_k")
        if top_k < 0:
            raise WorkbenchError(f"top_k must be >= 0, got {top_k}")
        top_p = real_number(self.top_p, "top_p", finite=False)
        if not 0 < top_p <= 1:
            raise WorkbenchError(f"top_p must be in (0, 1], got {self.top_p}")
        seed = None if self.seed is None else checked_seed(self.seed)
        # the checked values, as plain Python numbers (a numpy integer or float becomes an int or a float)
        for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
            object.__setattr__(self, name, value)

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()  # a nondeterministic seed of its own (torch.seed() would reseed torch's global generators too)
        else:
            g.manual_seed(self.seed)
        return g

    def pick(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        """One token id from float32 logits ``[vocab]``."""
        if self.temperature == 0:
            return int(layer_ops.argmax(logits))
        # the cuts rank tokens by their logits, not by logits / temperature: an infinite temperature makes those all
        # 0 (sampling uniformly over what the cuts keep), which would leave top-k and top-p nothing to rank
        logits = logits.float().cpu()
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.where(torch.isfinite(logits), logits / self.temperature, logits).softmax(-1)
        if self.top_p < 1:
            order = logits.argsort(descending=True, stable=True)
            sorted_probs = probs[order]
            # keep the smallest prefix whose mass reaches top_p (always at least the best token)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))


# Smallest static cache a built decode step attends over: its shape is compiled in.
MIN_STEP_CAPACITY = 256


def check_max_new_tokens(value: Any) -> int:
    """``max_new_tokens`` as an int, or a clear error: a count, so not a float, a string, None or a bool."""
    try:
        if isinstance(value, bool):
            raise TypeError
        count = operator.index(value)
    except TypeError:
        raise WorkbenchError(f"max_new_tokens must be an integer >= 0, got {shorten(value)}") from None
    if count < 0:
        raise WorkbenchError(f"max_new_tokens must be an integer >= 0, got {count}")
    return count


def generate_tokens(runner: Transformer, prompt_ids: Sequence[int], max_new_tokens: int,
                    sampling: Sampling = Sampling(), stop_ids: set[int] = frozenset(), hooks: Hooks | None = None,
                    cache: KVCache | None = None, compiled: bool | str | None = None, lora: Lora | None = None
                    ) -> Iterator[int]:
    """Yield new token ids. The prompt is prefilled once; each step feeds one token through the cache.

    With ``cache``, the prompt tokens continue it and generation appends to it: it ends holding the prompt and every
    token yielded, a stop token included (``_decode``), so a later call continuing it equals a fresh run on the whole
    text (with ``max_new_tokens=0`` the prompt alone is fed). With no hooks and no
    caller-owned cache, ``compiled`` (default: ``"background"`` on CUDA, False on the CPU) builds the decode step once with
    ``torch.compile``, which fuses the small ops between the matmuls (our kernels, called from the graph):
    on CUDA the build is captured as a CUDA graph and replayed, on the CPU the compiled step is called
    per token. Either way it is the same forward without a Python round trip per op. The first build for
    a cache size compiles it (tens of seconds on an 8B GPU model; on a 2-core CPU about 2.5 minutes the
    first time, then seconds from torch's on-disk cache); the runner keeps its last step per numerics,
    with its cache, for the next call of that size. ``compiled="background"`` answers at once: the tokens
    come from the eager forward (on CUDA, a CUDA graph of it) while a thread builds the step, and the step takes
    over at the first token boundary after it is ready (its cache a copy of the eager steps'). The compiled step
    fuses ops, so its logits may differ from the eager forward's in the last bits; which tokens of a
    generation each computed then depends on when the build finished: ``compiled=True`` waits for it. On CUDA, greedy decoding also picks each next token inside
    the graph and reads tokens back one step behind, so the GPU never waits on Python between steps.

    The numerics (``workbench.kernels.numerics``) are taken when this is called: every step computes in them,
    wherever the tokens are read. ``lora``: the adapters' terms (``Transformer.forward``); a built step holds them as
    inputs of its own (``DecodeStep.lora``), so adapters whose terms have the same shapes share one step.
    """
    if not prompt_ids:
        raise WorkbenchError("generation needs at least one prompt token")
    check_max_new_tokens(max_new_tokens)
    if not isinstance(sampling, Sampling):
        raise WorkbenchError(f"sampling must be a Sampling, got {type(sampling).__name__}")
    if cache is not None:
        runner.check_cache(cache)
    start = cache.next_position if cache is not None else 0
    if start + len(prompt_ids) + max_new_tokens > runner.config.n_ctx:
        raise WorkbenchError(
            f"prompt ({len(prompt_ids)} tokens) + cache ({start}) + {max_new_tokens} new tokens "
            f"exceed the context of {runner.config.n_ctx}"
        )
    if compiled is None:
        # on CUDA the first tokens replay a graph of the eager forward while the compiled step builds; on the CPU a
        # build would take both cores from the eager steps
        compiled = "background" if runner.device.type == "cuda" else False
    if compiled not in (True, False, "background"):
        raise WorkbenchError(f"compiled must be True, False, 'background' or None, got {compiled!r}")
    # a model split over devices decodes eagerly: a CUDA graph captures the stream of one device
    built_step = compiled if cache is None and not hooks and not runner.is_split else False
    return _decode(runner, list(prompt_ids), max_new_tokens, sampling, stop_ids, hooks, cache, built_step,
                   get_numerics(), lora)


@dataclass(eq=False)
class DecodeStep:
    """A one-token forward over a static cache, built once: ``step(token)`` runs it and returns its logits (a batch's
    step, ``step(tokens)``, one token for each row of a ``StaticBatchKVCache``). The step also writes the argmax of the
    logits into ``token``, its own next input when decoding greedily.
    ``run`` replays a CUDA graph (on CUDA) or calls the compiled forward (on the CPU); ``step(token)`` runs it in the
    numerics it was built in, whatever numerics block the caller is in, so a build never computes in other ones
    (torch.compile cannot guard on a ``ContextVar``: the numerics are a constant of the graph).

    A step built for a run with adapters reads their terms from ``lora``, tensors of its own that are inputs of the
    graph, as ``token`` is: ``load_lora`` copies a call's terms into them, so one step serves every adapter choice
    whose terms have the same shapes (``lora_shape``) and switching adapters rebuilds nothing."""

    run: Callable[[], torch.Tensor]  # one step on ``token``, returning its logits [rows, vocab] float32
    cache: StaticKVCache | StaticBatchKVCache
    token: torch.Tensor  # [rows] long, on the device: one a batch row (one for a single sequence)
    busy: bool = False  # a generation is using it (and its cache)
    provisional: bool = False  # a graph of the eager forward, answering until a compiled step replaces it
    numerics: Numerics = field(default_factory=get_numerics)  # what its matmuls compute, fixed when it was built
    lora: Lora | None = None  # the adapters' terms it computes with (None: the base)

    def __call__(self, next_tokens: int | Sequence[int]) -> torch.Tensor:
        if isinstance(next_tokens, int):
            self.token.fill_(next_tokens)
        else:
            self.token.copy_(torch.tensor(next_tokens, dtype=torch.long))
        with numerics(self.numerics):
            return self.run()

    def load_lora(self, lora: Lora | None) -> None:
        """Copy a call's adapter terms (of this step's ``lora_shape``) into the tensors the step reads."""
        for mine, theirs in zip(self.lora or (), lora or ()):
            for group, (a, b_t, _, _) in mine.items():
                a.copy_(theirs[group][0])
                b_t.copy_(theirs[group][1])


def lora_shape(lora: Lora | None) -> tuple | None:
    """What a built step is specialised to in a run's adapter terms: per layer, each adapted group's projections and
    the shapes of its A and B^T and their ranks (None: the base). Adapters of one rank on the same projections share
    it."""
    if lora is None:
        return None
    return tuple(tuple((group, tuple(a.shape), tuple(b_t.shape), adapted, ranks)
                       for group, (a, b_t, adapted, ranks) in layer.items()) for layer in lora)


def own_lora(lora: Lora | None) -> Lora | None:
    """A copy of adapter terms for a built step to hold (``DecodeStep.lora``)."""
    if lora is None:
        return None
    return [{group: (a.clone(), b_t.clone(), adapted, ranks) for group, (a, b_t, adapted, ranks) in layer.items()}
            for layer in lora]


def step_key(mode: Numerics, lora: Lora | None) -> Hashable:
    """A built step's key among its runner's: its numerics, and with adapters the shape of their terms."""
    return mode if lora is None else (mode, lora_shape(lora))


# Each runner's last built step per key (``step_key``), reused by the next generation of the same cache size and key.
# Each holds a static cache (and on CUDA a graph's memory): a runner keeps at most MAX_BUILT_STEPS, the least recently
# built or taken dropped first.
_BUILT: "weakref.WeakKeyDictionary[Transformer, dict[Hashable, DecodeStep]]" = weakref.WeakKeyDictionary()
MAX_BUILT_STEPS = 4
# CUDA builds finished after their generation ended, their graphs still to capture (``BackgroundBuild``).
_PENDING: "weakref.WeakKeyDictionary[Transformer, dict[Hashable, BackgroundBuild]]" = weakref.WeakKeyDictionary()


def forget_built_steps(runner: Transformer) -> None:
    """Drop the runner's built steps (its weights changed: a CUDA graph would read the old ones)."""
    _BUILT.pop(runner, None)
    _PENDING.pop(runner, None)


def _keep_step(runner: Transformer, key: Hashable, decode_step: DecodeStep) -> None:
    """Keep ``decode_step`` as the runner's step of ``key``, the most recent; past MAX_BUILT_STEPS, free steps of other
    keys go, the oldest first."""
    steps = _BUILT.setdefault(runner, {})
    steps.pop(key, None)
    steps[key] = decode_step
    for old in [k for k, s in steps.items() if k != key and not s.busy][:max(0, len(steps) - MAX_BUILT_STEPS)]:
        del steps[old]


def _built_step(runner: Transformer, capacity: int, key: Hashable, provisional: bool = False,
                lora: Lora | None = None) -> DecodeStep | None:
    """The runner's built step of ``key`` (``step_key``: a CUDA graph replays the kernels it captured, a compiled graph
    calls those it was traced with) if it is free and of this size, taken (busy) with its cache emptied and the call's
    adapter terms ``lora`` loaded; a provisional one only if ``provisional``."""
    pending = _PENDING.get(runner, {}).pop(key, None)
    if pending is not None:  # a CUDA build that outlived its generation: its graph is captured here
        pending.keep_free()
    decode_step = _BUILT.get(runner, {}).get(key)
    if (decode_step is None or decode_step.busy or decode_step.cache.capacity != capacity
            or (decode_step.provisional and not provisional)):
        return None
    decode_step.busy = True
    _keep_step(runner, key, decode_step)
    decode_step.cache.rewind(torch.zeros_like(decode_step.cache.device_length))
    decode_step.load_lora(lora)
    return decode_step


def _decode(runner: Transformer, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, stop_ids: set[int],
            hooks: Hooks | None, cache: KVCache | None, built_step: bool, mode: Numerics,
            lora: Lora | None = None) -> Iterator[int]:
    """The tokens of ``_decode_steps``; a caller's ``cache`` ends holding the prompt and every token yielded.

    The steps feed each token but the last (its pick ends the loop); here the last one is fed too, with the
    generation's hooks, adapters and numerics, so that continuing the cache equals a fresh run on the whole text.
    It is fed eagerly, one more one-token forward: a lazy feed would have to carry those hooks into a later call or
    into the cache's reads and surgery. A reader that leaves early (``close()``) gets the tokens it read fed, unless
    the cache changed since the last one (another forward or surgery in between). Without a caller's cache nothing
    changes: the steps' own cache is dropped."""
    if cache is None:
        yield from _decode_steps(runner, prompt_ids, max_new_tokens, sampling, stop_ids, hooks, None, built_step, mode,
                                 lora)
        return

    def feed(ids: list[int], step: int) -> None:
        with numerics(mode):
            runner.forward(torch.tensor(ids, dtype=torch.long), cache=cache, hooks=hooks, last_logits_only=True,
                           step=step, lora=lora)

    if max_new_tokens == 0:  # nothing to generate, but the prompt still continues the cache
        feed(prompt_ids, 0)
        return
    steps = _decode_steps(runner, prompt_ids, max_new_tokens, sampling, stop_ids, hooks, cache, False, mode, lora)
    count = length = 0
    try:
        for token in steps:
            count, length = count + 1, cache.length
            yield token
    except GeneratorExit:
        steps.close()
        if count and cache.length == length:
            feed([token], count)
        raise
    if count:
        feed([token], count)


def _decode_steps(runner: Transformer, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling,
                  stop_ids: set[int], hooks: Hooks | None, cache: KVCache | None, built_step: bool, mode: Numerics,
                  lora: Lora | None = None) -> Iterator[int]:
    if max_new_tokens == 0:
        return
    # With a cache of its own and no hooks but edits (interventions), nothing of the forward outlives a step but token
    # ids: it runs under inference mode, which skips autograd's bookkeeping on every op (eager CPU decode 5-10 % faster:
    # docs/performance.md, "Eager decode under inference mode").
    inference = cache is None and edits_only(hooks)
    decode_step = build = None
    start_build = False
    key = step_key(mode, lora)
    if built_step:  # a power of two, so most prompts reuse the step built for an earlier one
        capacity = len(prompt_ids) + max_new_tokens
        capacity = min(runner.config.n_ctx, max(MIN_STEP_CAPACITY, 1 << (capacity - 1).bit_length()))
        decode_step = _built_step(runner, capacity, key, provisional=built_step == "background", lora=lora)
        # one build per runner and key at a time: a generation that starts while one runs decodes without it
        start_build = (built_step == "background" and max_new_tokens > 1
                       and (decode_step is None or decode_step.provisional) and BackgroundBuild.may_start(runner, key))
        cache = decode_step.cache if decode_step is not None else runner.new_static_cache(capacity)
    elif cache is None:
        cache = runner.new_cache(len(prompt_ids) + max_new_tokens)
    try:
        generator = sampling.generator()
        # Each forward enters the numerics itself: a block around a ``yield`` would leak into the reader's code.
        with torch.inference_mode(inference), numerics(mode):
            logits = runner.forward(torch.tensor(prompt_ids, dtype=torch.long), cache=cache, hooks=hooks,
                                    last_logits_only=True, lora=lora)
        token = sampling.pick(logits[-1], generator)
        yield token
        if token in stop_ids or max_new_tokens == 1:
            return
        if built_step is True and decode_step is None:
            with numerics(mode):
                decode_step = build_decode_step(runner, cache, lora=lora)
            if decode_step is not None:
                decode_step.busy = True
                _keep_step(runner, key, decode_step)
        if built_step == "background" and decode_step is None and runner.device.type == "cuda":
            # a graph of the eager forward, captured in milliseconds before the build thread starts launching
            # kernels: replays need the GIL only a few times a step, so the compile does not starve them. It is
            # kept as the runner's step, for the next generations too, until the compiled one replaces it.
            with numerics(mode):
                decode_step = _capture(runner, cache, _forward_and_pick, "decoding eagerly", own_lora(lora))
            if decode_step is not None:
                decode_step.busy = decode_step.provisional = True
                _keep_step(runner, key, decode_step)
        if start_build:
            build = BackgroundBuild.start(runner, capacity, mode, lora)
        for step in range(1, max_new_tokens):
            if build is not None and build.ready():
                decode_step, build = build.take(cache) or decode_step, None
            if decode_step is not None and sampling.temperature == 0 and runner.device.type == "cuda":
                for token, in _replay_greedy(decode_step, token, max_new_tokens - step, build):
                    yield token
                    if token in stop_ids:
                        return
                return
            if decode_step is not None:
                logits = decode_step(token)
            else:
                with torch.inference_mode(inference), numerics(mode):
                    logits = runner.forward(torch.tensor([token]), cache=cache, hooks=hooks, last_logits_only=True,
                                            step=step, lora=lora)
            token = sampling.pick(logits[-1], generator)
            yield token
            if token in stop_ids:
                return
    finally:
        if decode_step is not None:
            decode_step.busy = False
        if build is not None:
            build.abandon()


class BackgroundBuild:
    """A decode step built in a thread of its own, on a static cache of its own, while the caller decodes eagerly.

    The thread computes in the numerics of the call (a ``ContextVar`` does not cross into a new thread). On CUDA it
    compiles and warms the step up on a side stream; the graph is captured by ``take``, on the caller's thread,
    with no other thread launching kernels. ``take(cache)`` copies the eager steps' ``cache`` into the step's and
    keeps the step as the runner's built step of its key (``step_key``: busy, as ``_built_step`` hands one out). A
    build still running when its generation ends finishes and is kept the same way, free, for the next generation."""

    _running: "weakref.WeakKeyDictionary[Transformer, set[Hashable]]" = weakref.WeakKeyDictionary()
    _failed: "weakref.WeakKeyDictionary[Transformer, set[Hashable]]" = weakref.WeakKeyDictionary()

    def __init__(self, runner: Transformer, capacity: int, mode: Numerics, lora: Lora | None = None):
        self._runner = weakref.ref(runner)
        self.mode = mode
        self.key = step_key(mode, lora)
        self.lora = own_lora(lora)
        self.cache = runner.new_static_cache(capacity)
        self.step: DecodeStep | None = None
        self._warm: Callable[[], torch.Tensor] | None = None
        self._abandoned = False
        self._done = threading.Event()
        self._lock = threading.Lock()

    @classmethod
    def start(cls, runner: Transformer, capacity: int, mode: Numerics, lora: Lora | None = None) -> "BackgroundBuild":
        build = cls(runner, capacity, mode, lora)
        cls._running.setdefault(runner, set()).add(build.key)
        threading.Thread(target=build._run, name="workbench-decode-build", daemon=True).start()
        return build

    @classmethod
    def may_start(cls, runner: Transformer, key: Hashable) -> bool:
        """No build of ``key`` runs for ``runner``, and none failed (a failure would repeat at every call)."""
        return key not in cls._running.get(runner, ()) and key not in cls._failed.get(runner, ())

    def _run(self) -> None:
        runner = self._runner()
        try:
            if runner is None:
                return
            with numerics(self.mode):
                if runner.device.type == "cuda":
                    self._warm = _compiled_cuda_forward(runner, self.cache, self.lora)
                else:
                    self.step = _compile_on_cpu(runner, self.cache, self.lora)
        except Exception as err:  # a failed build leaves the generation eager
            warnings.warn(f"building the decode step failed, decoding eagerly: {err}", RuntimeWarning, stacklevel=2)
        finally:
            if runner is not None and self.step is None and self._warm is None:
                self._failed.setdefault(runner, set()).add(self.key)
            self._done.set()
            with self._lock:
                if self._abandoned and self.step is not None:
                    self._keep(busy=False)
                elif self._abandoned and self._warm is not None and runner is not None:
                    # a CUDA graph is captured on a caller's thread only: the next generation's
                    _PENDING.setdefault(runner, {})[self.key] = self
            if runner is not None:
                self._running.get(runner, set()).discard(self.key)

    def ready(self) -> bool:
        return self._done.is_set()

    def take(self, cache: StaticKVCache) -> DecodeStep | None:
        """The built step, continuing from ``cache`` (None if the build failed)."""
        self._keep(busy=True)
        if self.step is not None:
            self.step.cache.copy_from(cache)
        return self.step

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            if self.ready():
                self._keep(busy=False)

    def keep_free(self) -> None:
        self._keep(busy=False)

    def _keep(self, busy: bool) -> None:
        runner = self._runner()
        if self.step is None and self._warm is not None and runner is not None:
            with numerics(self.mode):  # the capture runs the warmed-up forward once more, in the build's numerics
                self.step = _capture(runner, self.cache, self._warm, "decoding eagerly", self.lora, warm=False)
            self._warm = None
        if self.step is not None and runner is not None:
            self.step.busy = busy
            _keep_step(runner, self.key, self.step)


def generate_batch_tokens(runner: Transformer, prompts: dict[int, list[int]], max_new_tokens: int,
                          sampling: Sampling = Sampling(), stop_ids: set[int] = frozenset(),
                          hooks: Hooks | None = None, mode: Numerics | None = None,
                          lora: Lora | LoraRows | None = None, static_step: bool | None = None
                          ) -> Iterator[tuple[int, int]]:
    """Yield ``(prompt, token id)`` for a batch of prompts (``{prompt index: ids}``) decoded together: one batched
    prefill, then one batched step per token over a ``BatchKVCache``, each prompt with its own generator (seeded
    alike, so each samples what ``generate_tokens`` samples for it alone). A prompt leaves the batch, and its cache
    row is dropped, when it stops. ``hooks`` are batch-level (``hooks.per_prompt_hooks``). Every forward computes in
    the numerics ``mode`` (default: those current when this is called), with the adapters' terms ``lora`` (one choice
    for all, or ``LoraRows`` in the order of ``prompts``).

    ``static_step`` (default: on CUDA): greedy decoding whose hooks are all capturable (``runner.capturable``: edits of
    whole tokens that every prompt shares, at positions None or ``"generated"``), with one adapter choice or none, on a
    model on one device, runs its steps after the prefill as one step of every row over a ``StaticBatchKVCache``
    (lengths, rope positions, mask and write slots on the device), each row's next token picked on the device: on
    CUDA a CUDA graph of that step, captured once per call and replayed per token with the tokens read back one step
    behind (as ``generate_tokens`` does for one prompt; if the capture fails, the steps run eagerly, with a warning);
    elsewhere the same step run eagerly. Rows that stopped keep running in it, their tokens ignored: a row's cache
    slots are read by no other row. The step attends over the cache's whole capacity, the eager one over the longest
    row, so logits may differ in the last bits (sums over more, masked, slots)."""
    mode = mode or get_numerics()
    if static_step is None:
        static_step = runner.device.type == "cuda"
    return _decode_batch(runner, prompts, max_new_tokens, sampling, stop_ids, hooks, mode, lora, static_step)


def _holds_batch_step(runner: Transformer, sampling: Sampling, hooks: Hooks | None, lora: Lora | LoraRows | None,
                      capacity: int) -> bool:
    """Whether a batch's greedy decode steps can run as one static step (``generate_batch_tokens``)."""
    return (sampling.temperature == 0 and capturable(hooks) and not isinstance(lora, LoraRows)
            and not runner.is_split and _graph_holds_moe(runner) and capacity <= runner.config.n_ctx)


def _decode_batch(runner: Transformer, prompts: dict[int, list[int]], max_new_tokens: int, sampling: Sampling,
                  stop_ids: set[int], hooks: Hooks | None, mode: Numerics, lora: Lora | LoraRows | None,
                  static_step: bool = False) -> Iterator[tuple[int, int]]:
    if max_new_tokens == 0:
        return
    order = list(prompts)
    rows = [prompts[i] for i in order]
    capacity = max(map(len, rows)) + max_new_tokens
    generators = [sampling.generator() if sampling.temperature else None for _ in order]
    # with one adapter choice and no hooks but edits that every prompt shares at every token (a Steer at positions
    # None or "generated": runner.capturable), prefixes that prompts start with (a system prompt, a template) are
    # computed once
    groups = [] if (hooks and not capturable(hooks)) or isinstance(lora, LoraRows) else prefix_groups(rows)
    static_step = static_step and max_new_tokens > 1 and _holds_batch_step(runner, sampling, hooks, lora, capacity)
    # the batch's cache is its own (see _decode); a static step's cache and tokens are written between its runs,
    # outside any mode, and a CUDA graph has no autograd bookkeeping to skip
    inference = edits_only(hooks) and not static_step
    with torch.inference_mode(inference), numerics(mode):  # around each forward alone: the caller runs between yields
        if groups:
            cache, _ = runner.prefill_prefixes(rows, groups, capacity, hooks, last_logits_only=True, lora=lora)
        else:
            cache = runner.new_batch_cache(len(rows), capacity)
    shared = list(cache.lengths)
    layout = BatchLayout([len(r) - n for r, n in zip(rows, shared)], runner.device, prompts=order, cached=shared)
    packed = torch.tensor([t for r, n in zip(rows, shared) for t in r[n:]], dtype=torch.long)
    for step in range(max_new_tokens):
        with torch.inference_mode(inference), numerics(mode):
            logits = runner.forward(packed, cache=cache, hooks=hooks, last_logits_only=True, step=step, layout=layout,
                                    lora=lora)
        if sampling.temperature == 0:
            tokens = layer_ops.argmax(logits).tolist()  # one read-back for the whole batch
        else:
            tokens = [sampling.pick(row, g) for row, g in zip(logits, generators)]
        keep = []
        for b, (prompt, token) in enumerate(zip(order, tokens)):
            yield prompt, token
            if token not in stop_ids and step + 1 < max_new_tokens:
                keep.append(b)
        if not keep:
            return
        if step == 0 and static_step:
            with numerics(mode):
                decode_step = _batch_step(runner, StaticBatchKVCache(cache), hooks, lora, order)
            if decode_step is not None:  # every row runs on; only the rows still going are read
                for step_tokens in _replay_greedy(decode_step, tokens, max_new_tokens - 1):
                    for b in keep:
                        yield order[b], step_tokens[b]
                    keep = [b for b in keep if step_tokens[b] not in stop_ids]
                    if not keep:
                        return
                return
        if len(keep) < len(order):
            cache.keep_rows(keep)
            order, tokens, generators = ([xs[b] for b in keep] for xs in (order, tokens, generators))
            lora = lora.keep(keep) if isinstance(lora, LoraRows) else lora
        layout = BatchLayout([1] * len(order), runner.device, prompts=order, cached=cache.lengths)
        packed = torch.tensor(tokens, dtype=torch.long)


def _batch_step(runner: Transformer, cache: StaticBatchKVCache, hooks: Hooks | None, lora: Lora | None,
                prompts: Sequence[int]) -> DecodeStep | None:
    """The one-token-per-row forward of a batch of ``prompts`` over ``cache`` with the capturable ``hooks``, each
    row's argmax its next input: on CUDA a CUDA graph of it (None if the capture fails), elsewhere the forward run
    eagerly. It computes in the numerics current here."""
    layout = BatchLayout([1] * cache.n_rows, runner.device, prompts=prompts)
    forward_and_pick = functools.partial(_forward_and_pick, hooks=hooks, layout=layout)
    if runner.device.type == "cuda":
        return _capture(runner, cache, forward_and_pick, "decoding eagerly", lora, rows=cache.n_rows)
    token = torch.zeros(cache.n_rows, dtype=torch.long, device=runner.device)
    mode = get_numerics()

    def run() -> torch.Tensor:
        with numerics(mode):
            return forward_and_pick(runner, token, cache, lora)

    return DecodeStep(run, cache, token, numerics=mode, lora=lora)


def _replay_greedy(decode_step: DecodeStep, tokens: int | Sequence[int], n_steps: int,
                   build: BackgroundBuild | None = None) -> Iterator[list[int]]:
    """Greedy tokens, one list a step (a token a row), from ``n_steps`` runs of a step that picks its own next input
    on the device, fed ``tokens`` first; the caller stops early by leaving the loop.

    On CUDA each replay is queued before the tokens of the previous one are read back, so the GPU never waits for
    the host; a stop token costs one step that is thrown away (its cache slot is never read). When ``build`` is
    ready, its step takes over from a copy of the cache and the next input, queued after the last replay. (On the
    CPU, where a batch's static step runs eagerly, each step is read as it finishes.)
    """
    cuda = decode_step.token.is_cuda
    host = torch.empty(decode_step.token.shape, dtype=torch.long, pin_memory=cuda)
    copied = torch.cuda.Event() if cuda else None
    decode_step(tokens)  # the replays below select no kernels: the graph holds those of its numerics
    for remaining in range(n_steps - 1, -1, -1):
        host.copy_(decode_step.token, non_blocking=cuda)
        if cuda:
            copied.record()
        if build is not None and build.ready():
            built = build.take(decode_step.cache)
            if built is not None:
                built.token.copy_(decode_step.token)
                decode_step = built
            build = None
        if remaining:
            decode_step.run()
        if cuda:
            copied.synchronize()
        yield host.tolist()


def build_decode_step(runner: Transformer, cache: StaticKVCache, compiled: bool = True,
                      lora: Lora | None = None) -> DecodeStep | None:
    """The runner's one-token forward over ``cache``, built to run once per token (None if that fails), with the
    adapter terms ``lora`` (copied into tensors of the step's own, ``DecodeStep.lora``).

    With ``compiled``, it is ``torch.compile``'s build of that same forward, which fuses the small ops
    between the matmuls (norms, rope, attention softmax, the argmax over the vocabulary); the matmuls stay
    our kernels. On CUDA the step is captured as a CUDA graph (if compiling fails, the eager forward is
    captured); on the CPU it is the compiled forward (generated C++ calling our kernels' ops), and
    ``compiled=False`` has nothing to build. The step computes in the numerics current here (``DecodeStep.numerics``).
    """
    lora = own_lora(lora)
    if runner.device.type != "cuda":
        # The CPU runs an MoE's experts by the routing read back on the host, in Python between graphs: a compiled step
        # (which keeps no guards on such values, see _guards_on_global_state) would keep the experts of its build.
        return _compile_on_cpu(runner, cache, lora) if compiled and runner.config.moe is None else None
    if not _graph_holds_moe(runner):
        return None
    if compiled:
        step = _capture(runner, cache, _compiled_cuda_forward(runner, cache, lora, warm=False),
                        "capturing the eager forward instead", lora)
        if step is not None:
            return step
    return _capture(runner, cache, _forward_and_pick, "decoding eagerly", lora)


def _graph_holds_moe(runner: Transformer) -> bool:
    """Whether a CUDA graph holds the model's experts: not where they are grouped by the routing read on the host."""
    return runner.config.moe is None or all(by_pair_supported(layer.moe, runner.device)
                                            for layer in runner.weights.layers if layer.moe is not None)


def _compiled_cuda_forward(runner: Transformer, cache: StaticKVCache, lora: Lora | None,
                           warm: bool = True) -> Callable[..., torch.Tensor]:
    """``torch.compile``'s build of the one-token forward for a CUDA step with the adapter terms ``lora`` (the step's
    own tensors), compiled by two warm-up runs on a side stream when ``warm`` (the cache rewound after them)."""
    # Combo kernels launch independent neighbours together (the ropes and the cache writes): 7 glue kernels per
    # layer instead of 9, and the 8B Q4_K step 1.7-1.9 % faster on an H100 (docs/performance.md, "The compiled
    # decode step").
    forward = torch.compile(_step_code(step_key(get_numerics(), lora)), dynamic=False,
                            options={"combo_kernels": True})
    if warm:
        _warm_up(runner, cache, forward, torch.zeros(1, dtype=torch.long, device=runner.device), lora)
    return forward


def _warm_up(runner: Transformer, cache: StaticKVCache, forward_and_pick: Callable[..., torch.Tensor],
             token: torch.Tensor, lora: Lora | None) -> None:
    """Two runs on a side stream (compiling kernels, settling allocations), the cache rewound after them."""
    saved = cache.device_length.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward_and_pick(runner, token, cache, lora)
            cache.rewind(saved)
    torch.cuda.current_stream().wait_stream(side)


def _forward_and_pick(runner: Transformer, token: torch.Tensor, cache: StaticKVCache | StaticBatchKVCache,
                      lora: Lora | None = None, hooks: Hooks | None = None,
                      layout: BatchLayout | None = None) -> torch.Tensor:
    """The logits for ``token``, whose argmax then replaces it: the next greedy input, already on the device. With a
    ``layout``, ``token`` holds one token for each row of a batch (``cache`` a ``StaticBatchKVCache``), each replaced
    by its row's argmax, as the eager batched steps pick it."""
    logits = runner.forward(token, cache=cache, hooks=hooks, last_logits_only=True, layout=layout, lora=lora)
    token.copy_(argmax_by_chunks(logits[-1]).view(1) if layout is None else logits.argmax(-1))
    return logits


def argmax_by_chunks(values: torch.Tensor, chunks: int = 128) -> torch.Tensor:
    """``values.argmax()`` of a 1-D tensor (the first of equal maxima) in two stages: the maxima of ``chunks``
    slices, then the best of those. One long row is otherwise reduced by a single thread block (~30 us
    over a 128k vocabulary on an H100, 1 % of an 8B decode step)."""
    width = -(-values.shape[0] // chunks)
    padded = F.pad(values, (0, width * chunks - values.shape[0]), value=float("-inf"))
    best, where = padded.view(chunks, width).max(dim=1)
    chunk = best.argmax(dim=0, keepdim=True)  # a tensor index: indexing with a Python int would sync
    return (chunk * width + where.gather(0, chunk)).squeeze(0)


def _capture(runner: Transformer, cache: StaticKVCache | StaticBatchKVCache,
             forward_and_pick: Callable[..., torch.Tensor], fallback: str, lora: Lora | None, warm: bool = True,
             rows: int = 1) -> DecodeStep | None:
    """A CUDA graph of ``forward_and_pick`` on ``cache`` with the adapter terms ``lora`` (the step's own tensors: the
    graph reads them where they are, as it reads ``token``, of ``rows`` tokens), after two warm-up runs unless
    ``warm`` is False (they ran already, ``_compiled_cuda_forward``)."""
    token = torch.zeros(rows, dtype=torch.long, device=runner.device)
    saved = cache.device_length.clone()

    def step() -> torch.Tensor:
        return forward_and_pick(runner, token, cache, lora)

    try:
        if warm:  # warm-up compiles kernels and settles allocations, off the graph
            _warm_up(runner, cache, forward_and_pick, token, lora)
        graph = torch.cuda.CUDAGraph()
        # thread-local: a build thread may be compiling beside this capture, on its own stream and cache
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = step()
    except Exception as err:  # a compiler error, or a kernel that syncs or allocates on the host
        warnings.warn(f"CUDA graph capture failed, {fallback}: {err}", RuntimeWarning, stacklevel=3)
        cache.rewind(saved)
        return None
    cache.rewind(saved)

    def replay() -> torch.Tensor:
        graph.replay()
        return logits

    return DecodeStep(replay, cache, token, lora=lora)


def _guards_on_global_state(entries: list[Any]) -> list[bool]:
    """torch.compile's guards to keep for a decode step: those on module globals (the kernel registry) and on torch's
    global state. (The numerics are a ``ContextVar``, which torch.compile reads as a constant without a guard: each
    build is of one numerics, a code object of its own, and runs in them, see ``DecodeStep``.) A step is only ever called with the runner, token and cache it was built
    for, so the ~2800 guards on those arguments (every weight's metadata) would protect nothing; checking them took
    ~1 ms of a 5 ms CPU step on the embedded model."""
    return [entry.is_global or not entry.name for entry in entries]


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own. torch.compile keeps its builds per code object; without the guards on
    the arguments, a step sharing one with another runner's step could run that runner's build."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


@functools.cache
def _step_code(key: Hashable) -> Callable[..., torch.Tensor]:
    """The CUDA steps' forward, one code object per ``step_key``: torch.compile keeps its builds per code object and
    guards on the arguments there, so a build is reused for another runner or cache of the same numerics (and shape
    of adapter terms), never of others, and many adapter shapes never exhaust one object's recompile limit."""
    return _own_code(_forward_and_pick)


def _compile_on_cpu(runner: Transformer, cache: StaticKVCache, lora: Lora | None) -> DecodeStep | None:
    token = torch.zeros(1, dtype=torch.long, device=runner.device)
    saved = cache.device_length.clone()
    # The C++ wrapper calls the kernels' ops without Python in between: ~1 ms less per step on the embedded model.
    forward_and_pick = torch.compile(_own_code(_forward_and_pick), dynamic=False,
                                     options={"cpp_wrapper": True, "guard_filter_fn": _guards_on_global_state})

    # The step is the value of a weak dictionary keyed by its runner: a strong reference back would keep both alive.
    runner_ref = weakref.ref(runner)

    def step() -> torch.Tensor:
        return forward_and_pick(runner_ref(), token, cache, lora)

    try:
        step()  # compiles
    except Exception as err:  # no C++ compiler, or a compiler error
        warnings.warn(f"compiling the decode step failed, decoding eagerly: {err}", RuntimeWarning, stacklevel=3)
        return None
    finally:
        cache.rewind(saved)
    return DecodeStep(step, cache, token, lora=lora)
