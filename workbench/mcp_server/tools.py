"""The tools: every workbench operation, on the public API, with limits, ids for server-side objects and small results.

Each tool is a method ``name(self, call, **arguments) -> result model``; ``call`` carries the client's session and
its cancellation flag. The MCP layer (``server.py``) publishes these methods as they are: their signatures are
the tools' input schemas, their return models the output schemas, their docstrings the descriptions.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Literal

import torch
from pydantic import Field

import workbench
from workbench import hooks, probes, results
from workbench.errors import WorkbenchError, clip, shorten
from workbench.hooks.points import axes, head_count, token_shape
from workbench.kernels import get_numerics
from workbench.kernels.linear import Numerics
from workbench.messages import check_messages, is_messages
from workbench.model import recorded_prompt
from workbench.probes.lens import token_id
from workbench.quant_mix import check_quantize
from workbench.replay import replay
from workbench.mcp_server import schemas as s
from workbench.mcp_server.state import Artifacts, Cancelled, Limits, Models, Session, Sessions

TOOLS: list[str] = []


def tool(method: Callable) -> Callable:
    """Mark a method as an MCP tool (published in definition order)."""
    TOOLS.append(method.__name__)
    return method


@dataclass
class Call:
    """One tool call: the caller's session and the flag set when the client cancels."""

    session: Session
    cancelled: threading.Event

    def check(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled("the request was cancelled")


# ------------------------------------------------------------------------------------------ argument types

# a text, or a conversation (workbench.messages): checked by Model.to_ids, whose errors name the bad message
ChatPrompt = str | list[dict[str, Any]]
CONVERSATION = ("or a conversation: a list of {'role', 'content'} messages (strings), rendered through the model's "
                "chat template (a last assistant message is continued, else the generation prompt follows)")
Prompt = Annotated[ChatPrompt, Field(description=f"prompt text, {CONVERSATION}")]
Prompts = Annotated[list[ChatPrompt], Field(description=f"prompts, each a text {CONVERSATION}; run together in "
                                                        "batched forwards")]
Chat = Annotated[bool, Field(description="wrap a text prompt as one user message in the model's chat template (a "
                                         "conversation always is)")]
TopK = Annotated[int, Field(description="how many most likely next tokens to return")]
Hook = Annotated[str, Field(description="hook point name, e.g. blocks.12.hook_resid_post (list_hook_points)")]
Record = Annotated[list[str], Field(description="hook names or globs to record into the trace, e.g. "
                                                "['blocks.*.hook_resid_post']")]
Positions = Annotated[list[int] | None, Field(description="token positions (negative count from the end); "
                                                          "all when omitted")]
Heads = Annotated[list[int] | None, Field(description="attention heads (for per-head points); all when omitted")]
Specs = Annotated[list[dict[str, Any]], Field(description=(
    "intervention specs as in workbench.hooks: {'type': 'zero_ablate'|'mean_ablate'|'resample_ablate'|'steer'|"
    "'patch'|'scale'|'composite', 'hook': ..., 'positions'?, 'heads'?, 'neurons'?, ...}; on mixture-of-experts "
    "models also {'type': 'ablate_expert'|'force_routing'|'steer_expert', 'experts': [...], 'layer'?, ...} "
    "(docs/families.md). A steer 'vector' may be "
    "{'id': <vector id>} (without 'hook': at every layer of that vector), a patch 'donor' a prompt or "
    "{'id': <trace id>}"))]
Targets = Annotated[list[str], Field(description="single-token strings (e.g. ' Paris') whose logprobs to report")]
Layer = Annotated[int, Field(description="layer index")]
TraceId = Annotated[str, Field(description="a trace id from run, an edit tool or load_trace")]
CacheId = Annotated[str, Field(description="a KV cache id from kv_create or kv_clone")]
MaxNew = Annotated[int, Field(description="most tokens to generate")]
Seed = Annotated[int, Field(description="random seed (sampling, splits, subsets)")]
Temperature = Annotated[float, Field(description="sampling temperature; 0 is greedy")]
Dataset = Annotated[str, Field(description="a shipped dataset (list_datasets) or a .jsonl file in the artifacts "
                                           "folder")]
Sample = Annotated[int | None, Field(description="use a seeded subset of about this many records")]
Verify = Annotated[int, Field(ge=0, description="attribution only: patch this many cells of the largest estimated "
                                                "effect, to check the estimates (a forward each)")]
Pooling = Annotated[str, Field(description="'last' token or 'mean' over tokens")]


def _finite_or_none(values: Iterable[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def _compact(spec: Any) -> Any:
    """An intervention spec for display: long number lists (vectors, means) shown by size and norm."""
    if isinstance(spec, dict):
        return {k: _compact(v) for k, v in spec.items()}
    if isinstance(spec, list) and len(spec) > 16 and all(isinstance(v, (int, float)) for v in spec):
        return {"size": len(spec), "norm": math.sqrt(sum(float(v) ** 2 for v in spec))}
    if isinstance(spec, list):
        return [_compact(v) for v in spec]
    return spec


def _donor_prompts(spec: Any) -> list[Any]:
    """The prompts an intervention spec would run as donors (a patch's donor, a resample's donors)."""
    if not isinstance(spec, dict):
        return []
    donors = list(spec["donors"]) if isinstance(spec.get("donors"), (list, tuple)) else []
    donor = spec.get("donor")
    if isinstance(donor, (str, list)):
        donors.append(donor)
    return [d for d in donors if isinstance(d, (str, list))]


def _is_ref(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"id"}


def _shape(tensor: torch.Tensor) -> list[int]:
    return [int(n) for n in tensor.shape]


class Workbench:
    """The shared model(s), every session's objects, the artifacts folder and the limits."""

    def __init__(self, model: Any, artifacts: str | Path = "artifacts", limits: Limits = Limits(),
                 model_name: str | None = None, loader: Callable[[Path | None, str | None], Any] | None = None):
        self.limits = limits
        self.artifacts = Artifacts(artifacts)
        default_name = model_name or (Models.EMBEDDED if model.path == _embedded_path() else Path(model.path).name)
        self.models = Models(model, default_name, limits,
                             loader or (lambda path, quantize: workbench.load(path, device=str(model.device),
                                                                               quantize=quantize)))
        self.sessions = Sessions(limits, default_name, get_numerics())  # the numerics the server starts in
        # One forward at a time: concurrent clients then get exactly what they would get one after another.
        self.lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ helpers

    def model(self, call: Call) -> Any:
        return self.models.get(call.session.model_name)

    def _ids(self, model: Any, prompt: ChatPrompt | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list) and len(prompt) > self.limits.max_prompt_tokens:
            raise WorkbenchError(f"the prompt has {len(prompt)} tokens or messages; this server takes at most "
                                 f"{self.limits.max_prompt_tokens} tokens")
        text = (sum(len(m["role"]) + len(m["content"]) for m in check_messages(prompt)) if is_messages(prompt)
                else len(prompt) if isinstance(prompt, str) else 0)
        if text > 64 * self.limits.max_prompt_tokens:
            # no token is this long on average: refused before a huge text is tokenized (or templated)
            raise WorkbenchError(f"the prompt has {text:,} characters; this server takes at most "
                                 f"{self.limits.max_prompt_tokens} tokens")
        ids = model.to_ids(prompt, chat=chat)
        if len(ids) > self.limits.max_prompt_tokens:
            raise WorkbenchError(f"the prompt has {len(ids)} tokens; this server takes at most "
                                 f"{self.limits.max_prompt_tokens}")
        return ids

    def _positions(self, positions: list[int], n_tokens: int) -> list[int]:
        """Absolute token positions (negative ones count from the end), each checked."""
        bad = [p for p in positions if not -n_tokens <= p < n_tokens]
        if bad or not positions:
            raise WorkbenchError(f"positions {bad or positions} out of range for {n_tokens} tokens")
        return [p % n_tokens for p in positions]

    def _check_count(self, what: str, n: int, limit: int) -> None:
        if not 1 <= n <= limit:
            raise WorkbenchError(f"{what} must be between 1 and {limit}, got {n}")

    def _distribution(self, model: Any, logits: torch.Tensor, top_k: int) -> s.Distribution:
        return s.Distribution(**results.next_token(logits, top_k, model).to_dict())

    def _record_names(self, model: Any, record: list[str], n_tokens: int) -> list[str]:
        names = list(dict.fromkeys(n for pattern in record for n in hooks.resolve(pattern, model.config)))
        shapes = model.hook_points()
        size = sum(_shape_size(shapes[n], n_tokens) for n in names)
        if size > self.limits.max_record_values:
            raise WorkbenchError(f"recording {len(names)} hook points over {n_tokens} tokens keeps {size:,} values; "
                                 f"the limit is {self.limits.max_record_values:,} (record fewer points)")
        return names

    def _check_cost(self, model: Any, prompts: Iterable[ChatPrompt | list[int]] = (), chat: bool = False,
                    specs: Iterable[Any] = (), new_tokens: int | None = None) -> list[list[int]]:
        """The one check of what a request would cost before anything runs: each prompt's tokens, every intervention
        (the leaves of nested composites counted, their nesting bounded), the donor prompts they would run (counted
        and each measured like a prompt) and the tokens to generate. Returns the prompts' ids. Every tool that runs
        a forward passes here, replays of saved traces included."""
        prompts, ids = list(prompts), []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(self._ids(model, prompt, chat))
            except WorkbenchError as err:
                if len(prompts) == 1:
                    raise
                raise type(err)(f"prompt {i}: {err}") from None
        leaves = [leaf for spec in specs for leaf in hooks.spec_leaves(spec)]
        if len(leaves) > self.limits.max_interventions:
            raise WorkbenchError(f"{len(leaves)} interventions (composite parts counted); the limit is "
                                 f"{self.limits.max_interventions}")
        donors = [donor for leaf in leaves for donor in _donor_prompts(leaf)]
        if len(donors) > self.limits.max_batch:
            raise WorkbenchError(f"{len(donors)} donor prompts; the limit is {self.limits.max_batch}")
        for donor in donors:
            self._ids(model, donor)
        if new_tokens is not None:
            self._check_count("max_new_tokens", new_tokens, self.limits.max_new_tokens)
        return ids

    def _interventions(self, call: Call, specs: list[dict[str, Any]]) -> list[hooks.Intervention]:
        """Intervention objects from JSON specs, with {'id': ...} references to server-side objects resolved."""
        self._check_cost(self.model(call), specs=specs)
        return [i for spec in specs for i in self._expand(call, spec)]

    def _expand(self, call: Call, spec: Any) -> list[hooks.Intervention]:
        """One spec as interventions. A steer whose vector is a stored steering vector's id acts at the spec's
        hook with that layer's direction, or, without a hook, at every layer of the vector."""
        if not isinstance(spec, dict):
            return [hooks.from_spec(spec)]
        spec = dict(spec)
        if isinstance(spec.get("parts"), list):
            spec["parts"] = [i for part in spec["parts"] for i in self._expand(call, part)]
        if _is_ref(spec.get("donor")):
            spec["donor"] = call.session.get("trace", spec["donor"]["id"])
        if spec.get("type") in hooks.interventions.FEATURE_KINDS:
            spec["sae"] = self._sae(call, spec.get("sae"))
        if _is_ref(spec.get("vector")):
            if spec.get("type") != "steer":
                raise WorkbenchError(f"a stored vector's id stands in a steer spec, not {shorten(spec.get('type'))}")
            vector = call.session.get("vector", spec["vector"]["id"])
            if "hook" not in spec:
                unknown = sorted(set(spec) - {"type", "vector", "scale", "positions"})
                if unknown:
                    raise WorkbenchError(f"a steer by a stored vector at its own layers takes scale and positions, "
                                         f"not {shorten(unknown)}")
                return vector.interventions(spec.get("scale", 1.0), spec.get("positions"))
            layer = next((layer for layer in vector.layers if vector.hook(layer) == spec["hook"]), None)
            if layer is None:
                raise WorkbenchError(f"vector {spec['vector']['id']} has directions at "
                                     f"{[vector.hook(layer) for layer in vector.layers]}, not {shorten(spec['hook'])}")
            spec["vector"] = vector.directions[layer]
        return [hooks.from_spec(spec)]

    def _run(self, call: Call, prompt: ChatPrompt, chat: bool = False, record: list[str] = (),
             interventions: list[hooks.Intervention] = ()) -> tuple[str, hooks.Trace]:
        """One forward through Model.run; the trace is kept in the session and its id returned."""
        trace = self._traced(call, prompt, chat, record, interventions)
        return call.session.put("trace", trace), trace

    def _traced(self, call: Call, prompt: ChatPrompt, chat: bool = False, record: list[str] = (),
                interventions: list[hooks.Intervention] = ()) -> hooks.Trace:
        model = self.model(call)
        ids = self._check_cost(model, [prompt], chat)[0]
        names = self._record_names(model, list(record), len(ids))
        call.check()
        trace = model.run(ids, record=names, interventions=interventions, chat=chat)
        # run as ids (templated and checked once); the trace keeps the text or conversation
        trace.prompt, trace.chat = recorded_prompt(prompt, ids), chat or is_messages(prompt)
        return trace

    def _summaries(self, trace: hooks.Trace) -> list[s.ActivationSummary]:
        """Shape, norm and max of each recorded activation; per-position norms while they fit the size limit."""
        per_position = len(trace.activations) * len(trace.ids) <= self.limits.max_values
        return [s.ActivationSummary(**summary.to_dict())
                for summary in results.summarize_activations(trace, per_position)]

    def _compare(self, call: Call, prompt: ChatPrompt, specs: list[dict[str, Any]], chat: bool, top_k: int,
                 targets: list[str], record: list[str] = ()) -> s.EditResult:
        """Baseline and edited runs of one prompt, and how the next-token distribution moved."""
        model = self.model(call)
        self._check_count("top_k", top_k, self.limits.max_top_k)
        interventions = self._interventions(call, specs)
        target_ids = [token_id(model, t) for t in targets]
        # the edited run first, and both traces kept only once both ran: a refused edit leaves nothing behind
        edited = self._traced(call, prompt, chat, record, interventions)
        baseline = self._traced(call, prompt, chat, record)
        baseline_id, edited_id = call.session.put_all("trace", [baseline, edited])
        comparison = results.compare_next_token(baseline.logits[-1], edited.logits[-1], model, top_k, target_ids)
        return s.EditResult(trace_id=edited_id, baseline_trace_id=baseline_id,
                            interventions=_compact(edited.interventions), **comparison.to_dict())

    def trace_summary(self, call: Call, trace_id: str) -> s.TraceSummary:
        """What list_traces and the trace:// resources show of one trace."""
        entry = call.session.entry("trace", trace_id)
        return self._summarize(call, trace_id, entry.value, entry.note.get("path"))

    def _summarize(self, call: Call, trace_id: str, trace: hooks.Trace, path: str | None) -> s.TraceSummary:
        next_token = None
        if trace.logits is not None:
            # a loaded trace may come from a model of another vocabulary: its tokens are then not this model's to name
            model, width = self.model(call), trace.logits.shape[-1]
            vocab = model if width == model.config.vocab_size else None
            next_token = s.Distribution(**results.next_token(trace.logits, min(5, width), vocab).to_dict())
        return s.TraceSummary(
            trace_id=trace_id, uri=f"trace://{trace_id}", prompt=trace.prompt, tokens=trace.tokens,
            next_token=next_token,
            interventions=_compact(trace.interventions), recorded={n: _shape(a) for n, a in trace.activations.items()},
            model=str(trace.fingerprint.get("file", "")), path=path)

    # ------------------------------------------------------------------------------------------- model

    @tool
    def list_models(self, call: Call) -> s.ModelList:
        """Models this server can use: those loaded, the embedded default, and GGUF files in the artifacts folder."""
        loaded = self.models.loaded()
        entries = {name: s.ModelEntry(name=name, path=path, loaded=True) for name, path in loaded.items()}
        if _embedded_path() is not None:
            entries.setdefault(Models.EMBEDDED, s.ModelEntry(name=Models.EMBEDDED, path=str(_embedded_path()),
                                                            loaded=False))
        for relative in self.artifacts.files("*.gguf"):
            entries.setdefault(relative, s.ModelEntry(name=relative, path=relative, loaded=False))
        return s.ModelList(current=call.session.model_name, models=list(entries.values()))

    @tool
    def load_model(self, call: Call,
                   path: Annotated[str, Field(description="'embedded', or a GGUF file / HF checkpoint folder "
                                                          "inside the artifacts folder")],
                   quantize: Annotated[str | None, Field(
                       description="HF checkpoints only: quantize on load, every matrix into one format ('Q8_0', "
                                   "'Q4_K', ...) or as llama.cpp's mix ('Q3_K_S/M/L', 'Q4_K_S/M', 'Q5_K_S/M')")]
                   = None) -> s.ModelInfo:
        """Load a model (or reuse it when loaded) and make it the one this session's tools use."""
        if quantize is not None:
            check_quantize(quantize)
            quantize = quantize.upper()
            if path == Models.EMBEDDED:
                raise WorkbenchError("quantize= applies to float checkpoints; the embedded model is a GGUF file")
        if path == Models.EMBEDDED or (quantize is None and path in self.models.loaded()):
            name, file = path, None
        else:
            file = self.artifacts.path(path)
            if not file.exists():
                raise WorkbenchError(f"no model {shorten(path)} in the artifacts folder {self.artifacts.root}")
            name = self.artifacts.relative(file) + (f"@{quantize}" if quantize else "")
        in_use = self.sessions.models_in_use(besides=call.session)
        self.models.load(name, file, in_use, quantize, replaces=call.session.model_name)
        call.session.model_name = name
        return self.model_info(call)

    @tool
    def model_info(self, call: Call) -> s.ModelInfo:
        """Architecture, size, device and tensor formats of this session's model."""
        model = self.model(call)
        c = model.config
        formats: dict[str, int] = {}
        for fmt in model.tensor_formats().values():
            formats[fmt] = formats.get(fmt, 0) + 1
        return s.ModelInfo(name=call.session.model_name, path=str(model.path), architecture=c.architecture,
                           n_layers=c.n_layers, d_model=c.d_model, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                           d_head=c.d_head, d_mlp=c.d_mlp, vocab_size=c.vocab_size, n_ctx=c.n_ctx,
                           parameters=c.n_params, device=str(model.device),
                           dtype=str(model.dtype).removeprefix("torch."), tensor_formats=formats,
                           numerics=call.session.numerics, moe=c.to_dict()["moe"])

    @tool
    def set_numerics(self, call: Call,
                     mode: Annotated[Numerics, Field(
                         description="'exact' floats, or 'llamacpp': activations quantized to Q8 blocks and integer "
                                     "dot products, as llama.cpp computes them")]) -> s.ModelInfo:
        """What this session's quantized matmuls compute from now on, so a finding can be checked under the numerics
        of the deployed engine; other sessions keep theirs."""
        call.session.numerics = mode
        return self.model_info(call)

    @tool
    def list_hook_points(self, call: Call,
                         pattern: Annotated[str | None, Field(description="a name or glob to expand, e.g. "
                                                                          "'blocks.3.attn.*'")] = None
                         ) -> s.HookPoints:
        """Hook points with their shapes (T tokens, S attended slots): per-block suffixes, global points, matches."""
        model = self.model(call)
        shapes = model.hook_points()
        block = {n.split(".", 2)[2]: shape for n, shape in shapes.items() if n.startswith("blocks.0.")}
        global_points = {n: shape for n, shape in shapes.items() if not n.startswith("blocks.")}
        matching = hooks.resolve(pattern, model.config) if pattern is not None else []
        return s.HookPoints(n_layers=model.config.n_layers, block_points=block, global_points=global_points,
                            matching=matching)

    @tool
    def moe_routing(self, call: Call, prompt: Prompt,
                    layers: Annotated[list[int] | None, Field(description="layers to report; all when omitted")]
                    = None, interventions: Specs = [], chat: Chat = False) -> s.MoERouting:
        """A mixture-of-experts model's routing of a prompt: per layer, each token's chosen experts and weights, and
        each expert's share of the tokens (with interventions, e.g. an 'ablate_expert' spec, the edited routing)."""
        model = self.model(call)
        moe = model.config.moe
        if moe is None:
            raise WorkbenchError(f"{call.session.model_name} is not a mixture-of-experts model")
        layers = list(range(model.config.n_layers)) if layers is None else layers
        bad = [i for i in layers if not 0 <= i < model.config.n_layers]
        if bad:
            raise WorkbenchError(f"layers {bad} out of range 0..{model.config.n_layers - 1}")
        record = [f"blocks.{i}.mlp.hook_expert_{part}" for i in layers for part in ("indices", "weights")]
        _, trace = self._run(call, prompt, chat, record, self._interventions(call, interventions))
        out = []
        for i in layers:
            experts = trace.activations[f"blocks.{i}.mlp.hook_expert_indices"]
            load = torch.bincount(experts.reshape(-1).long(), minlength=moe.n_experts) / experts.shape[0]
            out.append(s.LayerRouting(layer=i, experts=experts.tolist(), load=load.tolist(),
                                      weights=trace.activations[f"blocks.{i}.mlp.hook_expert_weights"].tolist()))
        return s.MoERouting(tokens=trace.tokens, n_experts=moe.n_experts, layers=out)

    @tool
    def tokenize(self, call: Call, text: Annotated[ChatPrompt, Field(description=f"text to tokenize, {CONVERSATION}")],
                 chat: Chat = False) -> s.Tokenization:
        """Token ids and token strings of a prompt (with BOS when the model adds one; a conversation as rendered)."""
        model = self.model(call)
        ids = self._ids(model, text, chat)
        return s.Tokenization(ids=ids, tokens=model.token_texts(ids))

    # ------------------------------------------------------------------------------------- run and read

    @tool
    def run(self, call: Call, prompt: Prompt, record: Record = [], top_k: TopK = 10,
            chat: Chat = False) -> s.RunResult:
        """One forward: the next-token distribution, and the recorded hooks kept in a server-side trace.

        Returns the trace id (for get_activation, save_trace, ...) with each recorded activation's shape and norms.
        """
        self._check_count("top_k", top_k, self.limits.max_top_k)
        trace_id, trace = self._run(call, prompt, chat, record)
        return s.RunResult(trace_id=trace_id, tokens=trace.tokens,
                           next_token=self._distribution(self.model(call), trace.logits[-1], top_k),
                           recorded=self._summaries(trace))

    @tool
    def run_batch(self, call: Call, prompts: Prompts, top_k: TopK = 10, interventions: Specs = [],
                  chat: Chat = False) -> s.BatchRunResult:
        """Many prompts in batched forwards (with the same interventions for each, positions counted per prompt): each
        prompt's tokens and next-token distribution. No traces are kept; use run for activations."""
        model = self.model(call)
        self._check_count("top_k", top_k, self.limits.max_top_k)
        self._check_count("prompts", len(prompts), self.limits.max_batch)
        ids = self._check_cost(model, prompts, chat)  # run as ids: templated and checked once
        edits = self._interventions(call, interventions)
        call.check()
        traces = model.run_batch(ids, interventions=edits, logits="last", progress=lambda done, total: call.check())
        return s.BatchRunResult(results=[s.PromptNextToken(tokens=t.tokens,
                                                           next_token=self._distribution(model, t.logits[-1], top_k))
                                         for t in traces])

    @tool
    def get_activation(self, call: Call, trace_id: TraceId, hook: Hook, positions: Positions = None,
                       heads: Heads = None,
                       feature_start: Annotated[int, Field(description="first index of the last axis")] = 0,
                       feature_stop: Annotated[int | None, Field(description="end (exclusive) of the last axis")] = None
                       ) -> s.ActivationSlice:
        """A slice of a recorded activation (size-bounded): positions x heads x a range of the last axis."""
        trace = call.session.get("trace", trace_id)
        if hook not in trace.activations:
            raise WorkbenchError(f"trace {trace_id} did not record {shorten(hook)}; it recorded: "
                                 f"{', '.join(trace.activations) or 'nothing (run with record=[...])'}")
        act, ax = trace.activations[hook], axes(hook)
        if trace.reduce is not None:  # a batch run kept one row per point (token-major ones only): one position
            act = act.unsqueeze(ax.token)
        n_tokens = act.shape[ax.token]
        positions = list(range(n_tokens)) if positions is None else self._positions(positions, n_tokens)
        x = act.index_select(ax.token, torch.tensor(positions))
        if heads is not None:
            if ax.head is None:
                raise WorkbenchError(f"{hook} has no head axis")
            if not heads:
                raise WorkbenchError("heads is empty: give head indices, or leave heads out for all")
            bad = [h for h in heads if not 0 <= h < act.shape[ax.head]]
            if bad:
                raise WorkbenchError(f"heads {bad} out of range 0..{act.shape[ax.head] - 1}")
            x = x.index_select(ax.head, torch.tensor(heads))
        last = act.dim() - 1
        width = act.shape[last]
        stop = width if feature_stop is None else feature_stop
        if last not in (ax.token, ax.head):
            if not 0 <= feature_start < stop <= width:
                raise WorkbenchError(f"feature range {feature_start}:{stop} outside 0:{width}")
            x = x.narrow(last, feature_start, stop - feature_start)
        if x.numel() > self.limits.max_values:
            raise WorkbenchError(f"the slice {list(x.shape)} has {x.numel():,} values; at most "
                                 f"{self.limits.max_values:,} are returned (select positions, heads or features)")
        return s.ActivationSlice(trace_id=trace_id, hook=hook, full_shape=_shape(act), shape=_shape(x),
                                 positions=positions, heads=heads, features=[feature_start, stop],
                                 values=_finite_or_none(x.flatten().tolist()))

    @tool
    def attention_pattern(self, call: Call, prompt: Prompt, layer: Layer, heads: Heads = None,
                          query_positions: Annotated[list[int] | None, Field(
                              description="query positions (negative from the end); the last one when omitted")] = None,
                          chat: Chat = False) -> s.AttentionPattern:
        """Attention weights of one layer: [head][query][key] for the chosen heads and query positions."""
        model = self.model(call)
        name = hooks.resolve(f"blocks.{layer}.attn.hook_pattern", model.config)[0]
        n_heads, n_tokens = model.config.n_heads, len(self._ids(model, prompt, chat))
        heads = list(range(n_heads)) if heads is None else heads
        if [h for h in heads if not 0 <= h < n_heads]:
            raise WorkbenchError(f"heads {heads} out of range 0..{n_heads - 1}")
        queries = self._positions([-1] if query_positions is None else query_positions, n_tokens)
        if len(heads) * len(queries) * n_tokens > self.limits.max_values:
            raise WorkbenchError(f"{len(heads) * len(queries) * n_tokens:,} weights; at most "
                                 f"{self.limits.max_values:,} are returned (choose heads or query positions)")
        trace_id, trace = self._run(call, prompt, chat, [name])
        selected = trace.activations[name][heads][:, queries]  # [heads, queries, keys]
        return s.AttentionPattern(trace_id=trace_id, layer=layer, heads=heads, tokens=trace.tokens,
                                  query_positions=queries, pattern=selected.tolist())

    @tool
    def logit_lens(self, call: Call, prompt: Prompt,
                   point: Annotated[str, Field(description="resid_pre, resid_mid or resid_post")] = "resid_post",
                   positions: Annotated[list[int] | None, Field(description="positions to read (negative from the "
                                                                            "end); the last one when omitted")] = None,
                   k: Annotated[int, Field(description="top tokens per layer and position")] = 5,
                   chat: Chat = False) -> s.Lens:
        """Logit lens: every layer's residual read through the final norm and unembedding; top-k tokens per layer."""
        model = self.model(call)
        self._check_count("k", k, self.limits.max_top_k)
        n_tokens = len(self._ids(model, prompt, chat))
        positions = self._positions([-1] if positions is None else positions, n_tokens)
        n_layers = model.config.n_layers
        if n_layers * len(positions) * k > self.limits.max_values:
            raise WorkbenchError(f"{n_layers * len(positions) * k:,} entries; at most {self.limits.max_values:,} "
                                 "are returned (fewer positions or a smaller k)")
        lens = probes.logit_lens(model, prompt, points=(point,), k=k, chat=chat)
        ids, probs = lens.top_ids[point], lens.top_probs[point]
        rows = [s.LensRow(layer=layer, position=pos, top=[
            s.TokenP(id=int(i), token=model.tokenizer.token_text(int(i)), prob=float(p))
            for i, p in zip(ids[layer, pos], probs[layer, pos])]) for layer in range(n_layers) for pos in positions]
        return s.Lens(tokens=lens.tokens, point=point, positions=positions, rows=rows)

    @tool
    def track_token(self, call: Call, prompt: Prompt,
                    tokens: Annotated[list[str], Field(description="single-token strings to follow, e.g. [' Paris']")],
                    point: Annotated[str, Field(description="resid_pre, resid_mid or resid_post")] = "resid_post",
                    positions: Annotated[list[int] | None, Field(description="positions (negative from the end); "
                                                                             "the last one when omitted")] = None,
                    chat: Chat = False) -> s.TokenTrackResult:
        """Probability and rank of chosen tokens at every layer (logit lens), and where each first becomes top-1."""
        model = self.model(call)
        n_tokens = len(self._ids(model, prompt, chat))
        positions = self._positions([-1] if positions is None else positions, n_tokens)
        self._check_count("tokens", len(tokens), self.limits.max_top_k)
        if 2 * len(tokens) * len(positions) * model.config.n_layers > self.limits.max_values:
            raise WorkbenchError(f"{len(tokens)} tokens x {len(positions)} positions x {model.config.n_layers} layers "
                                 f"is more than the {self.limits.max_values:,} numbers returned at once")
        for token in tokens:
            token_id(model, token)
        track = probes.logit_lens(model, prompt, points=(point,), k=1, chat=chat).track_race(tokens, point)
        series = []
        for i, (tracked, text) in enumerate(zip(track.token_ids, track.token_texts)):
            for pos in positions:
                ranks = track.ranks[i, :, pos].tolist()
                series.append(s.TrackSeries(token=text, id=tracked, position=pos,
                                            probs=track.probs[i, :, pos].tolist(), ranks=ranks,
                                            first_top1_layer=next((l for l, r in enumerate(ranks) if r == 0), None)))
        return s.TokenTrackResult(tokens=track.prompt_tokens, point=point, series=series)

    @tool
    def direct_logit_attribution(self, call: Call, prompt: Prompt,
                                 target: Annotated[str, Field(description="single-token string, e.g. ' Paris'")],
                                 baseline: Annotated[str | None, Field(description="attribute target minus this "
                                                                                   "token's logit")] = None,
                                 position: Annotated[int, Field(description="position (negative from the end)")] = -1,
                                 top: Annotated[int, Field(description="how many largest components")] = 10,
                                 chat: Chat = False) -> s.Attribution:
        """Split the target's logit (difference) over the embedding, every head and every MLP."""
        model = self.model(call)
        self._positions([position], len(self._ids(model, prompt, chat)))
        self._check_count("top", top, self.limits.max_top_k)
        dla = probes.direct_logit_attribution(model, prompt, target, baseline, position, chat)
        heads = dla.heads()
        mlps = [float(c) for c, kind in zip(dla.contributions, dla.kinds) if kind == "mlp"]
        return s.Attribution(
            target=dla.target, position=dla.position, logit=dla.logit, total=dla.total, error=dla.error,
            embed=float(dla.contributions[0]),
            top=[s.Component(label=label, kind=dla.kinds[dla.labels.index(label)], contribution=value)
                 for label, value in dla.top(top)],
            by_layer=[s.LayerAttribution(layer=l, attn=float(heads[l].sum()), mlp=mlps[l]) for l in range(len(mlps))])

    # ------------------------------------------------------------------------------------------- edit

    @tool
    def run_with_interventions(self, call: Call, prompt: Prompt, interventions: Specs, record: Record = [],
                               targets: Targets = [], top_k: TopK = 10, chat: Chat = False) -> s.EditResult:
        """Run a prompt with any combination of interventions: baseline vs edited distributions and the difference."""
        return self._compare(call, prompt, interventions, chat, top_k, targets, record)

    @tool
    def ablate(self, call: Call, prompt: Prompt, hook: Hook,
               method: Annotated[str, Field(description="'zero', 'mean' (over reference prompts) or 'resample' "
                                                        "(from reference prompts)")] = "zero",
               positions: Positions = None, heads: Heads = None,
               neurons: Annotated[list[int] | None, Field(description="feature indices; all when omitted")] = None,
               reference_prompts: Annotated[list[ChatPrompt], Field(description=(
                   f"prompts for mean / resample, each a text {CONVERSATION}"))] = [],
               targets: Targets = [], top_k: TopK = 10, chat: Chat = False) -> s.EditResult:
        """Ablate a region of a hook point (zero, mean or resample): baseline vs edited distributions."""
        region = {"hook": hook, "positions": positions, "heads": heads, "neurons": neurons}
        region = {k: v for k, v in region.items() if v is not None}
        if method == "zero":
            spec = {"type": "zero_ablate", **region}
        elif method in ("mean", "resample"):
            self._check_count("reference prompts", len(reference_prompts), self.limits.max_batch)
            if method == "resample":
                spec = {"type": "resample_ablate", "donors": reference_prompts, **region}
            else:
                model = self.model(call)
                reference_ids = [self._ids(model, reference) for reference in reference_prompts]
                names = hooks.resolve(hook, model.config)
                if len(names) != 1 or token_shape(names[0], model.config) is None:
                    raise WorkbenchError(f"mean ablation averages one hook point of a fixed per-token shape, not "
                                         f"{shorten(hook)}")
                self._record_names(model, names, sum(map(len, reference_ids)))  # what the references keep
                call.check()
                references = model.run_batch(reference_ids, record=names, logits=None,
                                             progress=lambda done, total: call.check())
                region.pop("hook")
                spec = hooks.MeanAblate.from_traces(names[0], references, **region).to_spec()
        else:
            raise WorkbenchError(f"method must be 'zero', 'mean' or 'resample', got {shorten(method)}")
        return self._compare(call, prompt, [spec], chat, top_k, targets)

    @tool
    def steer(self, call: Call, prompt: Prompt,
              hook: Annotated[str | None, Field(description="hook point to steer; with vector_id it may be omitted "
                                                            "to steer at every layer of the stored vector")] = None,
              vector: Annotated[list[float] | None, Field(description="steering vector (feature axis of the hook)")
                                ] = None,
              vector_id: Annotated[str | None, Field(description="a stored steering vector (steering_vector_from_"
                                                                 "dataset, import_control_vector)")] = None,
              scale: Annotated[float, Field(description="multiplier of the vector")] = 1.0,
              positions: Positions = None, targets: Targets = [], top_k: TopK = 10,
              chat: Chat = False) -> s.EditResult:
        """Add scale * vector at a hook point: baseline vs steered distributions and the difference."""
        if (vector is None) == (vector_id is None):
            raise WorkbenchError("give exactly one of vector and vector_id")
        if vector is not None and hook is None:
            raise WorkbenchError("a vector given as numbers needs the hook to add it at")
        spec: dict[str, Any] = {"type": "steer", "scale": scale,
                                "vector": vector if vector is not None else {"id": vector_id}}
        spec.update({k: v for k, v in (("hook", hook), ("positions", positions)) if v is not None})
        return self._compare(call, prompt, [spec], chat, top_k, targets)

    @tool
    def patch(self, call: Call, prompt: Prompt, hook: Hook,
              donor: Annotated[str | None, Field(description="donor prompt (recorded at the same positions)")] = None,
              donor_trace_id: Annotated[str | None, Field(description="a trace that recorded the hook, "
                                                                      "instead of a donor prompt")] = None,
              positions: Positions = None, heads: Heads = None, targets: Targets = [], top_k: TopK = 10,
              chat: Chat = False) -> s.EditResult:
        """Activation patching: overwrite a region with a donor run's activation; baseline vs patched distributions."""
        if (donor is None) == (donor_trace_id is None):
            raise WorkbenchError("give exactly one of donor and donor_trace_id")
        if donor is not None:
            self._ids(self.model(call), donor)
        spec: dict[str, Any] = {"type": "patch", "hook": hook,
                                "donor": donor if donor is not None else {"id": donor_trace_id}}
        spec.update({k: v for k, v in (("positions", positions), ("heads", heads)) if v is not None})
        return self._compare(call, prompt, [spec], chat, top_k, targets)

    @tool
    def generate(self, call: Call, prompt: Prompt, max_new_tokens: MaxNew = 32, interventions: Specs = [],
                 temperature: Temperature = 0.0,
                 top_k: Annotated[int, Field(description="sample from the k most likely (0: all)")] = 0,
                 top_p: Annotated[float, Field(description="nucleus mass")] = 1.0, seed: Seed = 0,
                 chat: Chat = False) -> s.Generation:
        """Generate a continuation, with interventions acting at every step when given."""
        model = self.model(call)
        ids = self._check_cost(model, [prompt], chat, new_tokens=max_new_tokens)[0]
        return self._generate(call, model, ids, max_new_tokens, interventions,
                              dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))

    @tool
    def generate_batch(self, call: Call, prompts: Prompts, max_new_tokens: MaxNew = 32, interventions: Specs = [],
                       temperature: Temperature = 0.0, seed: Seed = 0, chat: Chat = False) -> s.BatchGeneration:
        """Generate a continuation of each prompt, decoded together in batched steps (each prompt stops on its own;
        interventions act on each, positions counted per prompt)."""
        model = self.model(call)
        self._check_count("prompts", len(prompts), self.limits.max_batch)
        # run as ids: templated and checked once
        prompt_ids = self._check_cost(model, prompts, chat, new_tokens=max_new_tokens)
        edits = self._interventions(call, interventions)
        ids: list[list[int]] = [[] for _ in prompts]
        pieces: list[list[str]] = [[] for _ in prompts]
        for i, token, text in model.stream_batch(prompt_ids, max_new_tokens, interventions=edits,
                                                 temperature=temperature, seed=seed):
            ids[i].append(token)
            pieces[i].append(text)
            call.check()
        stop = model.tokenizer.stop_ids
        return s.BatchGeneration(generations=[
            s.Generation(text="".join(p), ids=i, tokens=model.token_texts(i), stopped=bool(i) and i[-1] in stop)
            for i, p in zip(ids, pieces)])

    def _generate(self, call: Call, model: Any, prompt: list[int], max_new_tokens: int, specs: list[dict[str, Any]],
                  sampling: dict[str, Any], cache: Any = None) -> s.Generation:
        self._check_cost(model, new_tokens=max_new_tokens)
        interventions = self._interventions(call, specs)
        ids, pieces = [], []
        for token, text in model.stream(prompt, max_new_tokens, interventions=interventions, cache=cache,
                                        **sampling):
            ids.append(token)
            pieces.append(text)
            call.check()
        return s.Generation(text="".join(pieces), ids=ids, tokens=model.token_texts(ids),
                            stopped=bool(ids) and ids[-1] in model.tokenizer.stop_ids)

    @tool
    def patching_sweep(self, call: Call, clean: Annotated[ChatPrompt, Field(description=f"clean prompt: a text "
                                                                                     f"{CONVERSATION}")],
                       corrupt: Annotated[ChatPrompt, Field(description="corrupt prompt, same number of tokens (a text "
                                                                        "or a conversation)")],
                       over: Annotated[list[str], Field(description="['layers', 'positions'], ['layers', 'heads'] or "
                                                                    "['layers', 'positions', 'heads']")
                                       ] = ["layers", "positions"],
                       hook: Annotated[str | None, Field(description="hook template with {layer}; default "
                                                                     "blocks.{layer}.hook_resid_pre (attn.hook_z for "
                                                                     "heads)")] = None,
                       layers: Annotated[list[int] | None, Field(description="layers to sweep; all when omitted")
                                         ] = None,
                       positions: Positions = None,
                       answers: Annotated[list[str] | None, Field(description="[clean answer, corrupt answer] "
                                                                              "single tokens; the metric is their "
                                                                              "logit difference (default: each run's "
                                                                              "top token)")] = None,
                       normalize: Annotated[bool, Field(description="0 = no effect, 1 = clean restored")] = False,
                       method: Annotated[Literal["activation", "attribution"], Field(
                           description="activation: each cell a patched forward; attribution: each cell's first-order "
                                       "estimate from one backward of the corrupt run (any number of cells, misses "
                                       "saturated effects)")] = "activation",
                       steps: Annotated[int, Field(ge=1, le=64, description=(
                           "attribution only: 1 takes the gradient in the corrupt run; more average the gradients "
                           "along the way from the corrupt inputs to the clean (integrated gradients: closer to "
                           "patching where effects saturate, a forward and backward each)"))] = 1,
                       verify: Verify = 0) -> s.PatchingSweep:
        """Activation patching sweep: patch each (layer, position | head) cell of the clean run into the corrupt run
        (or estimate every cell at once from gradients: attribution patching)."""
        model = self.model(call)
        hooks.check_patching_method(method, steps, verify)
        # the sweep runs on the checked ids: a conversation is rendered once
        clean_ids, corrupt_ids = self._ids(model, clean), self._ids(model, corrupt)
        cells = self._sweep_cells(model, len(clean_ids), over, hook, layers, positions)
        self._check_grid(cells)
        if method == "activation" and cells > self.limits.max_sweep:
            raise WorkbenchError(f"the sweep has {cells} cells (one forward each); the limit is "
                                 f"{self.limits.max_sweep}: choose layers or positions")
        if verify > self.limits.max_sweep:
            raise WorkbenchError(f"verify patches {verify} cells (one forward each); the limit is "
                                 f"{self.limits.max_sweep}")
        if answers is not None and len(answers) != 2:
            raise WorkbenchError(f"answers must be [clean answer, corrupt answer], got {len(answers)} strings")
        sweep = dict(over=over, hook=hook, layers=layers, positions=positions,
                     answers=tuple(answers) if answers else None, normalize=normalize)
        if method == "attribution":
            result = hooks.attribution_patching(model, clean_ids, corrupt_ids, **sweep, steps=steps, verify=verify)
        else:
            result = hooks.patching_sweep(model, clean_ids, corrupt_ids, **sweep,
                                          progress=lambda done, total: call.check())
        return s.PatchingSweep(**result.to_dict())

    def _check_grid(self, cells: int) -> None:
        if cells > self.limits.max_values:
            raise WorkbenchError(f"the sweep's grid has {cells:,} cells; at most {self.limits.max_values:,} numbers "
                                 "are returned: choose layers, positions or heads")

    @staticmethod
    def _sweep_cells(model: Any, n_tokens: int, over: list[str], hook: str | None, layers: list[int] | None,
                     positions: list[int] | None) -> int:
        """A sweep's cells (each a forward in activation patching), to refuse one past the limit before it runs."""
        n_layers = model.config.n_layers if layers is None else len(layers)
        template = hook or ("blocks.{layer}.attn.hook_z" if "heads" in over else "blocks.{layer}.hook_resid_pre")
        first = template.format(layer=layers[0] if layers else 0) if "{layer}" in template else template
        n_heads = (head_count(hooks.resolve(first, model.config)[0], model.config) or 1) if "heads" in over else 1
        return n_layers * (len(positions or range(n_tokens)) if "positions" in over else 1) * n_heads

    @tool
    def dataset_patching(self, call: Call,
                         dataset: Annotated[str | None, Field(description=(
                             "a shipped patching dataset (list_datasets, kind 'patching': 'ioi') or a .jsonl file of "
                             "that kind in the artifacts folder; its records' answers are the metric's"))] = None,
                         pairs: Annotated[list[s.PatchingPair] | None, Field(
                             description="the pairs themselves, instead of a dataset")] = None,
                         sample: Sample = None, seed: Seed = 0,
                         over: Annotated[list[str], Field(description="as patching_sweep's; a sweep over positions "
                                                                      "takes pairs of one token count")
                                         ] = ["layers", "positions"],
                         hook: Annotated[str | None, Field(description="as patching_sweep's")] = None,
                         layers: Annotated[list[int] | None, Field(description="layers to sweep; all when omitted")
                                           ] = None,
                         positions: Positions = None,
                         normalize: Annotated[bool, Field(description="by the mean metrics: 0 = no effect, 1 = clean "
                                                                      "restored")] = False,
                         method: Annotated[Literal["activation", "attribution"], Field(
                             description="as patching_sweep's; attribution runs the pairs batched")] = "attribution",
                         steps: Annotated[int, Field(ge=1, le=64, description="attribution's integrated-gradient "
                                                                              "steps, as patching_sweep's")] = 1,
                         verify: Verify = 0) -> s.PatchingSweep:
        """Patching over a dataset of (clean, corrupt) prompt pairs: each cell, and the clean and corrupt metrics, the
        mean of the pairs' (a circuit's components scored over a task, as EAP scores them)."""
        model = self.model(call)
        if (dataset is None) == (pairs is None):
            raise WorkbenchError("give a dataset or pairs, one of the two")
        if dataset is not None:
            prompts, answers = self._dataset(call, dataset, sample, seed).patching()
        else:
            if sample is not None:
                raise WorkbenchError("sample applies to a dataset")
            self._check_count("pairs", len(pairs), self.limits.max_batch // 2)
            given = [pair.answers is not None for pair in pairs]
            if any(given) and not all(given):
                raise WorkbenchError(f"pair {given.index(not given[0])}: give answers for every pair or for none")
            prompts = [(pair.clean, pair.corrupt) for pair in pairs]
            answers = [tuple(pair.answers) for pair in pairs] if all(given) else None
        ids = [(self._ids(model, clean), self._ids(model, corrupt)) for clean, corrupt in prompts]
        # activation patching runs a forward a cell of each pair, attribution a forward and backward a pair and step
        # and a forward a verified cell of each pair
        cells = [self._sweep_cells(model, len(clean), over, hook, layers, positions) for clean, _ in ids]
        self._check_grid(max(cells))
        runs = sum(cells) if method == "activation" else len(ids) * (steps + verify)
        if runs > self.limits.max_sweep:
            raise WorkbenchError(f"the sweep over {len(ids)} pairs runs {runs} forwards; the limit is "
                                 f"{self.limits.max_sweep}: choose fewer pairs, layers or positions")
        result = hooks.dataset_patching(model, ids, method=method, steps=steps, over=over, hook=hook, layers=layers,
                                        positions=positions, answers=answers, normalize=normalize, verify=verify,
                                        progress=lambda done, total: call.check())
        return s.PatchingSweep(**result.to_dict())

    # ---------------------------------------------------------------------------------------- KV cache

    def _cache(self, call: Call, cache_id: str) -> Any:
        """A cache of this session, made on the model the session runs now (else refused before any change)."""
        entry = call.session.entry("cache", cache_id)
        if entry.note.get("model") != call.session.model_name:
            raise WorkbenchError(f"cache {cache_id} was made on model {entry.note.get('model')!r}; this session now "
                                 f"runs {call.session.model_name!r}: create a new cache (kv_create)")
        return entry.value

    def _keep_cache(self, call: Call, cache: Any) -> str:
        return call.session.put("cache", cache, model=call.session.model_name)

    def _kv_info(self, call: Call, cache_id: str) -> dict[str, Any]:
        cache = self._cache(call, cache_id)
        return dict(cache_id=cache_id, length=cache.length, next_position=cache.next_position,
                    tokens=self.model(call).token_texts(cache.tokens), positions=cache.positions.tolist())

    def _kv_layer_index(self, call: Call, layer: int) -> int:
        n_layers = self.model(call).config.n_layers
        if not 0 <= layer < n_layers:
            raise WorkbenchError(f"layer {layer} outside 0..{n_layers - 1}")
        return layer

    @tool
    def kv_create(self, call: Call, prompt: Prompt, top_k: TopK = 10, chat: Chat = False) -> s.KVCreated:
        """Prefill a new KV cache with a prompt; returns its id, slots and the next-token distribution."""
        model = self.model(call)
        ids = self._ids(model, prompt, chat)
        self._check_count("top_k", top_k, self.limits.max_top_k)
        cache = model.new_cache()
        logits = model.forward(ids, cache=cache)
        cache_id = self._keep_cache(call, cache)
        return s.KVCreated(**self._kv_info(call, cache_id), next_token=self._distribution(model, logits[-1], top_k))

    @tool
    def kv_get_layer(self, call: Call, cache_id: CacheId, layer: Layer,
                     start: Annotated[int, Field(description="first slot")] = 0,
                     stop: Annotated[int | None, Field(description="end slot (exclusive); the cache length when "
                                                                    "omitted")] = None) -> s.KVLayer:
        """Keys and values of one layer for a slot range, [n_kv_heads, slots, d_head] each, row-major (size-bounded)."""
        cache = self._cache(call, cache_id)
        keys, values = cache.get(self._kv_layer_index(call, layer))
        stop = cache.length if stop is None else stop
        if not 0 <= start <= stop <= cache.length:
            raise WorkbenchError(f"slot range {start}:{stop} outside 0:{cache.length}")
        keys, values = keys[:, start:stop].float(), values[:, start:stop].float()
        if 2 * keys.numel() > self.limits.max_values:
            raise WorkbenchError(f"{2 * keys.numel():,} values; at most {self.limits.max_values:,} are returned "
                                 "(choose a slot range)")
        return s.KVLayer(cache_id=cache_id, layer=layer, shape=_shape(keys), slots=list(range(start, stop)),
                         keys=keys.flatten().tolist(), values=values.flatten().tolist())

    @tool
    def kv_set_layer(self, call: Call, cache_id: CacheId, layer: Layer,
                     source_cache_id: Annotated[str | None, Field(description="copy the layer from this cache "
                                                                             "(same length)")] = None,
                     keys: Annotated[list[float] | None, Field(description="[n_kv_heads, length, d_head] row-major")
                                     ] = None,
                     values: Annotated[list[float] | None, Field(description="same shape as keys")] = None
                     ) -> s.KVInfo:
        """Overwrite one layer's keys and values: from another cache, or from numbers."""
        cache = self._cache(call, cache_id)
        layer = self._kv_layer_index(call, layer)
        if source_cache_id is not None:
            if keys is not None or values is not None:
                raise WorkbenchError("give source_cache_id or keys and values, not both")
            cache.copy_layer_from(self._cache(call, source_cache_id), layer)
        else:
            if keys is None or values is None:
                raise WorkbenchError("give source_cache_id, or both keys and values")
            n_kv_heads, d_head = cache.layer_shape(layer)
            shape = (n_kv_heads, cache.length, d_head)
            if len(keys) > self.limits.max_values or len(values) > self.limits.max_values:
                raise WorkbenchError(f"at most {self.limits.max_values:,} numbers per tensor; copy larger layers "
                                     "with source_cache_id")
            if len(keys) != math.prod(shape) or len(values) != math.prod(shape):
                raise WorkbenchError(f"keys and values must hold {math.prod(shape)} numbers each (shape "
                                     f"{list(shape)}), got {len(keys)} and {len(values)}")
            cache.set(layer, torch.tensor(keys).view(shape), torch.tensor(values).view(shape))
        return s.KVInfo(**self._kv_info(call, cache_id))

    @tool
    def kv_clear_layer(self, call: Call, cache_id: CacheId, layer: Layer) -> s.KVInfo:
        """Zero one layer's keys and values: that layer's attention then sees no content in the cached slots."""
        self._cache(call, cache_id).clear(self._kv_layer_index(call, layer))
        return s.KVInfo(**self._kv_info(call, cache_id))

    @tool
    def kv_clone(self, call: Call, cache_id: CacheId) -> s.KVInfo:
        """An independent copy of a cache, under a new id."""
        clone = self._cache(call, cache_id).clone()
        return s.KVInfo(**self._kv_info(call, self._keep_cache(call, clone)))

    @tool
    def kv_clone_positions(self, call: Call, cache_id: CacheId,
                           start: Annotated[int, Field(description="first slot")],
                           stop: Annotated[int, Field(description="end slot (exclusive)")]) -> s.KVInfo:
        """A new cache holding slots start:stop of another (their rope positions kept)."""
        clone = self._cache(call, cache_id).clone_positions(start, stop)
        return s.KVInfo(**self._kv_info(call, self._keep_cache(call, clone)))

    @tool
    def kv_truncate(self, call: Call, cache_id: CacheId,
                    length: Annotated[int, Field(description="slots to keep")]) -> s.KVInfo:
        """Keep the first `length` slots; generation then continues from there."""
        self._cache(call, cache_id).truncate(length)
        return s.KVInfo(**self._kv_info(call, cache_id))

    @tool
    def kv_delete_positions(self, call: Call, cache_id: CacheId,
                            slots: Annotated[list[int], Field(
                                description="slot indices to remove (negative from the end)")]) -> s.KVInfo:
        """Remove slots; kept keys stay rotated at their original positions."""
        self._cache(call, cache_id).delete_positions(slots)
        return s.KVInfo(**self._kv_info(call, cache_id))

    @tool
    def kv_generate(self, call: Call, cache_id: CacheId,
                    prompt: Annotated[str, Field(description="text fed after the cache's slots")],
                    max_new_tokens: MaxNew = 16, interventions: Specs = [], temperature: Temperature = 0.0,
                    seed: Seed = 0) -> s.KVGeneration:
        """Continue a cache: feed the prompt after its slots, then generate; the cache grows in place
        (it ends holding the prompt and every generated token; kv_clone first to keep the original)."""
        model = self.model(call)
        cache = self._cache(call, cache_id)
        ids = model.tokenize(prompt, add_bos=False)  # a continuation: no BOS in the middle
        self._check_count("continuation tokens", len(ids), self.limits.max_prompt_tokens)
        if cache.length + len(ids) > self.limits.max_prompt_tokens + self.limits.max_new_tokens:
            raise WorkbenchError(f"the cache would exceed {self.limits.max_prompt_tokens + self.limits.max_new_tokens}"
                                 " slots; truncate or clone positions first")
        # the cache grows in place: the room it takes is reserved now, within the session's limits
        self._check_cost(model, new_tokens=max_new_tokens)
        n_new = len(ids) + max_new_tokens
        call.session.check_room(0, cache.nbytes // cache.capacity * (cache.capacity_for(n_new) - cache.capacity))
        cache.reserve(n_new)
        generation = self._generate(call, model, ids, max_new_tokens, interventions,
                                    dict(temperature=temperature, seed=seed), cache=cache)
        return s.KVGeneration(**self._kv_info(call, cache_id), generation=generation)

    @tool
    def kv_release(self, call: Call, cache_id: CacheId) -> s.Released:
        """Free a cache."""
        call.session.entry("cache", cache_id)
        call.session.release(cache_id)
        return s.Released(released=[cache_id])

    # ------------------------------------------------------------------------------ probes and vectors

    def _dataset(self, call: Call, name: str, sample: int | None, seed: int = 0) -> Any:
        """A shipped dataset by name or a JSONL file in the artifacts folder, optionally a seeded sample of it."""
        shipped = name in probes.list_datasets()
        data = probes.load_dataset(name if shipped else self.artifacts.path(name, must_exist=True))
        if sample is not None:
            data = data.sample(sample, seed)
        if len(data.prompts) > self.limits.max_batch:
            raise WorkbenchError(f"dataset {data.name!r} has {len(data.prompts)} prompts; one request takes at most "
                                 f"{self.limits.max_batch} (pass sample=)")
        model = self.model(call)
        for prompt in data.prompts:
            self._ids(model, prompt)
        return data

    def _vector_info(self, vector_id: str, vector: Any) -> s.VectorInfo:
        norms = vector.norms()
        return s.VectorInfo(vector_id=vector_id, point=vector.point, layers=vector.layers,
                            norms=_finite_or_none(norms[layer] for layer in vector.layers), source=vector.source,
                            hooks=[vector.hook(layer) for layer in vector.layers])

    # --------------------------------------------------------------------------------------- adapters

    @tool
    def load_adapter(self, call: Call,
                     path: Annotated[str, Field(description="a llama.cpp GGUF LoRA adapter or a PEFT adapter folder "
                                                            "inside the artifacts folder")],
                     name: Annotated[str | None, Field(description="what to call it (default: the file's stem)")]
                     = None,
                     scale: Annotated[float, Field(description="the scale it is used at")] = 1.0) -> s.AdapterInfo:
        """Make a LoRA adapter resident next to this session's model, checked against it (shapes, names, rank,
        NaN), without reloading the model; compare_models then runs it against the base."""
        file = self.artifacts.path(path)
        if not file.exists():
            raise WorkbenchError(f"no adapter {path!r} in the artifacts folder {self.artifacts.root}")
        return self._adapter_info(self.model(call).load_adapter(file, name=name, scale=scale).summary())

    @tool
    def list_adapters(self, call: Call) -> s.AdapterList:
        """The LoRA adapters resident next to this session's model, then those merged into its weights."""
        return s.AdapterList(adapters=[self._adapter_info(summary) for summary in self.model(call).list_adapters()])

    def _adapter_info(self, summary: dict[str, Any]) -> s.AdapterInfo:
        # a path inside the artifacts folder, relative to it; one loaded from elsewhere (the Python API) by name only
        path = Path(summary["path"]).resolve()
        shown = self.artifacts.relative(path) if path.is_relative_to(self.artifacts.root) else path.name
        return s.AdapterInfo(**{**summary, "path": shown})

    @tool
    def compare_models(self, call: Call, prompts: Prompts,
                       adapter: Annotated[str, Field(description="a loaded adapter's name (list_adapters)")],
                       base: Annotated[str | None, Field(description="another adapter to compare against; the base "
                                                                     "model when omitted")] = None,
                       target: Annotated[str | None, Field(description="single-token string whose logit change to "
                                                                       "attribute (default: the most raised)")] = None,
                       position: Annotated[int, Field(description="position of the lens and the attribution "
                                                                  "(negative from the end)")] = -1,
                       top: Annotated[int, Field(description="tokens and components to list")] = 5,
                       chat: Chat = False) -> s.ModelComparison:
        """Base against adapter on the same prompts, batched: residual difference per layer, logit lens of the
        difference, KL per position, the change of each component's direct logit attribution, and the "adapter
        minus base" steering vector (stored; steer with its id)."""
        model = self.model(call)
        self._check_count("prompts", len(prompts), self.limits.max_batch)
        self._check_count("top", top, self.limits.max_top_k)
        ids = [self._ids(model, prompt, chat) for prompt in prompts]
        for prompt_ids in ids:
            self._positions([position], len(prompt_ids))
        # both runs' recordings: every head's result and the residual stream, at every layer and position
        c = model.config
        size = 2 * sum(map(len, ids)) * c.n_layers * (c.n_heads + 3) * c.d_model
        if size > self.limits.max_record_values:
            raise WorkbenchError(f"comparing {len(ids)} prompts of {sum(map(len, ids))} tokens records {size:,} "
                                 f"values; the limit is {self.limits.max_record_values:,} (use fewer prompts)")
        call.check()
        diff = probes.compare_models(model, ids, adapter, base, target=target, position=position, k=top,
                                     progress=lambda done, total: call.check())
        summary = diff.summary(top)
        vector_id = call.session.put("vector", diff.steering)
        return s.ModelComparison(
            **{key: summary[key] for key in ("a", "b", "prompts", "mean_kl", "max_kl", "kl_per_position",
                                             "resid_diff_norm", "resid_diff_relative", "attribution_target")},
            **{key: [[s.LensTokenChange(token=t, change=v) for t, v in row] for row in summary[key]]
               for key in ("lens_promoted", "lens_suppressed")},
            attribution_top=[s.Component(label=label, kind=diff.attribution.kinds[diff.attribution.labels.index(label)],
                                         contribution=value) for label, value in summary["attribution_top"]],
            steering=self._vector_info(vector_id, diff.steering))

    @tool
    def list_datasets(self, call: Call) -> s.DatasetList:
        """Labelled prompt sets: the shipped ones and .jsonl files in the artifacts folder."""
        named = {name: probes.load_dataset(name) for name in probes.list_datasets()}
        skipped = []
        for name in self.artifacts.files("*.jsonl"):
            try:  # one malformed file is reported, and the others still listed
                named[name] = probes.load_dataset(self.artifacts.path(name))
            except WorkbenchError as err:
                skipped.append(f"{name}: {clip(str(err), 160)}")
        return s.DatasetList(datasets=[s.DatasetInfo(name=name, kind=d.kind, n_prompts=len(d.prompts),
                                                     description=d.description) for name, d in named.items()],
                             skipped=skipped)

    @tool
    def probe_train(self, call: Call, dataset: Dataset, hook: Hook,
                    pooling: Pooling = "last", test_size: Annotated[float, Field(description="held-out share")] = 0.25,
                    sample: Sample = None, seed: Seed = 0) -> s.ProbeInfo:
        """Fit a linear probe (PCA + logistic regression) on one hook over a labelled dataset; held-out accuracy."""
        data = self._dataset(call, dataset, sample, seed)
        probe = probes.train_probe(self.model(call), data, hook, pooling, test_size, seed,
                                   progress=lambda done, total: call.check())
        probe_id = call.session.put("probe", probe)
        return s.ProbeInfo(probe_id=probe_id, hook=probe.hook, pooling=probe.pooling, dataset=probe.dataset,
                           classes=probe.classes, accuracy=probe.accuracy, ci=list(probe.ci), n_train=probe.n_train,
                           n_test=probe.n_test)

    @tool
    def probe_apply(self, call: Call, probe_id: Annotated[str, Field(description="a probe id from probe_train")],
                    prompts: Annotated[list[ChatPrompt], Field(description=f"prompts to classify, each a text "
                                                                           f"{CONVERSATION}")]) -> s.ProbePredictions:
        """Classify prompts with a trained probe: label and class probabilities for each."""
        probe = call.session.get("probe", probe_id)
        model = self.model(call)
        ids = self._prompt_list(call, prompts)  # checked and tokenized once: the probe runs these ids
        probs = probe.predict_proba(model, ids, progress=lambda done, total: call.check())
        classes = probe.classes
        return s.ProbePredictions(probe_id=probe_id, predictions=[
            s.Prediction(prompt=prompt, label=classes[int(row.argmax())],
                         probs={c: float(p) for c, p in zip(classes, row)}) for prompt, row in zip(prompts, probs)])

    @tool
    def depth_sweep(self, call: Call, dataset: Dataset,
                    layers: Annotated[list[int] | None, Field(description="layers to probe; all when omitted")] = None,
                    point: Annotated[str, Field(description="resid_pre, resid_mid or resid_post")] = "resid_post",
                    pooling: Pooling = "last", folds: Annotated[int, Field(description="cross-validation folds")] = 5,
                    sample: Sample = None, seed: Seed = 0) -> s.DepthSweepResult:
        """Probe accuracy at every layer (k-fold cross-validated, 95% intervals): where is the label represented?"""
        data = self._dataset(call, dataset, sample, seed)
        sweep = probes.depth_sweep(self.model(call), data, layers=layers, point=point, pooling=pooling, folds=folds,
                                   seed=seed, progress=lambda done, total: call.check())
        return s.DepthSweepResult(
            dataset=sweep.dataset, point=sweep.point, pooling=sweep.pooling, n_examples=sweep.n_examples,
            layers=[s.LayerAccuracy(layer=l, fraction=sweep.fraction(l), accuracy=sweep.accuracy[l],
                                    ci=list(sweep.ci[l])) for l in sweep.layers],
            peak_layer=sweep.peak_layer, first_reaching_90=sweep.first_reaching(0.9))

    @tool
    def steering_vector_from_dataset(self, call: Call, dataset: Dataset,
                                     layers: Annotated[list[int], Field(description="layers to make directions at")],
                                     point: Annotated[str, Field(description="resid_pre, resid_mid or resid_post")
                                                      ] = "resid_post",
                                     pooling: Pooling = "mean",
                                     positive: Annotated[str | None, Field(description="the positive class of a "
                                                                                       "two-class dataset")] = None,
                                     sample: Sample = None) -> s.VectorInfo:
        """A steering vector: mean activation of positive minus negative prompts, per layer; stored by id."""
        data = self._dataset(call, dataset, sample)
        vector = probes.steering_vector(self.model(call), data, layers, point, pooling, positive,
                                        progress=lambda done, total: call.check())
        return self._vector_info(call.session.put("vector", vector), vector)

    @tool
    def export_control_vector(self, call: Call, vector_id: Annotated[str, Field(description="a stored vector")],
                              path: Annotated[str, Field(description="GGUF file to write, inside the artifacts "
                                                                     "folder")],
                              scale: Annotated[float, Field(description="multiplier baked into the file")] = 1.0
                              ) -> s.ExportedVector:
        """Write a stored steering vector as a llama.cpp control vector (llama-cli --control-vector FILE)."""
        vector = call.session.get("vector", vector_id)
        if not math.isfinite(scale):
            raise WorkbenchError(f"scale must be finite, got {scale}")
        # against the session's model: llama.cpp would refuse a file of another depth or width for it
        written = vector.export_control_vector(self.artifacts.target(path), scale, model=self.model(call))
        return s.ExportedVector(vector_id=vector_id, path=self.artifacts.relative(written),
                                bytes=written.stat().st_size, scale=scale)

    @tool
    def import_control_vector(self, call: Call,
                              path: Annotated[str, Field(description="a llama.cpp control vector GGUF inside the "
                                                                     "artifacts folder")]) -> s.VectorInfo:
        """Read a llama.cpp control vector into this session as a steering vector (direction.k -> blocks.k)."""
        vector = probes.SteeringVector.from_control_vector(self.artifacts.path(path, must_exist=True),
                                                           self.model(call))
        vector.source = path  # the artifacts-relative name, not the server's absolute path
        return self._vector_info(call.session.put("vector", vector), vector)

    # -------------------------------------------------------------------------------- sparse autoencoders

    def _sae(self, call: Call, reference: Any) -> Any:
        """An SAE from {'id': <sae id>} or a path inside the artifacts folder (never a path outside it)."""
        if _is_ref(reference):
            return call.session.get("sae", reference["id"])
        if not isinstance(reference, str):
            raise WorkbenchError(f"an SAE is {{'id': <sae id>}} (sae_load) or a path in the artifacts folder, got "
                                 f"{reference!r}")
        return probes.resolve_sae(self.artifacts.path(reference))  # a folder: load_sae says when nothing is there

    def _sae_info(self, sae_id: str, sae: Any) -> s.SaeInfo:
        path = sae.source
        if path is not None and Path(path).is_relative_to(self.artifacts.root):
            path = self.artifacts.relative(Path(path))
        return s.SaeInfo(sae_id=sae_id, architecture=sae.architecture, hook=sae.hook, hook_out=sae.hook_out,
                         d_in=sae.d_in, d_sae=sae.d_sae, k=sae.k, path=path)

    def _prompt_list(self, call: Call, prompts: list[ChatPrompt]) -> list[list[int]]:
        """Each prompt's checked ids (a conversation rendered once)."""
        self._check_count("number of prompts", len(prompts), self.limits.max_batch)
        model = self.model(call)
        return [self._ids(model, prompt) for prompt in prompts]

    @tool
    def sae_load(self, call: Call,
                 path: Annotated[str, Field(description="a SAELens folder (cfg.json + sae_weights.safetensors) or a "
                                                        "Gemma Scope params.npz, inside the artifacts folder")],
                 hook: Annotated[str | None, Field(description="the hook it reads: needed where the file does not "
                                                               "say (a params.npz outside a layer_<n> folder); "
                                                               "given, it overrides the file's")] = None) -> s.SaeInfo:
        """Load a sparse autoencoder or transcoder into this session, checked against the model; returns its id."""
        sae = probes.load_sae(self.artifacts.path(path), hook=hook)
        hooks.check_saes([sae], self.model(call).config)
        return self._sae_info(call.session.put("sae", sae), sae)

    @tool
    def sae_features(self, call: Call, prompt: Prompt, sae_id: Annotated[str, Field(description="an SAE id")],
                     top_k: Annotated[int, Field(description="features per token")] = 5) -> s.SaeFeatures:
        """The most active features of each token of a prompt."""
        self._check_count("top_k", top_k, self.limits.max_top_k)
        sae, model = call.session.get("sae", sae_id), self.model(call)
        ids = self._ids(model, prompt)
        call.check()
        rows = probes.top_features(model, sae, ids, top_k)
        return s.SaeFeatures(sae_id=sae_id, tokens=[s.TokenFeatures(position=r["position"], token=r["token"],
                                                                    features=[list(f) for f in r["features"]])
                                                    for r in rows])

    @tool
    def feature_top_examples(self, call: Call, sae_id: Annotated[str, Field(description="an SAE id")],
                             feature: Annotated[int, Field(description="feature index")],
                             prompts: Annotated[list[ChatPrompt], Field(description=f"the corpus to search, each a "
                                                                                    f"text {CONVERSATION}")],
                             n: Annotated[int, Field(description="how many top contexts")] = 10,
                             context: Annotated[int, Field(description="tokens shown either side")] = 8
                             ) -> s.FeatureExamples:
        """Where a feature fires most over the given prompts (contexts and activations), its density there, and the
        tokens its decoder direction promotes and suppresses."""
        sae, model = call.session.get("sae", sae_id), self.model(call)
        sae.check_feature(feature)
        self._check_count("n", n, self.limits.max_top_k)
        if not 0 <= context <= 64:
            raise WorkbenchError(f"context must be between 0 and 64 tokens, got {context}")
        prompts = self._prompt_list(call, prompts)
        stats = probes.feature_stats(model, sae, prompts, n, progress=lambda done, total: call.check())
        promoted = probes.promoted_tokens(model, sae, feature) if sae.d_out == model.config.d_model else {
            "promoted": [], "suppressed": []}
        return s.FeatureExamples(sae_id=sae_id, feature=feature, density=float(stats.density[feature]),
                                 examples=[s.FeatureExample(**e) for e in stats.examples(model, feature, context)],
                                 promoted=[list(p) for p in promoted["promoted"]],
                                 suppressed=[list(p) for p in promoted["suppressed"]])

    @tool
    def feature_steer(self, call: Call, prompt: Prompt, sae_id: Annotated[str, Field(description="an SAE id")],
                      feature: Annotated[int, Field(description="feature index")],
                      scale: Annotated[float, Field(description="added to the feature's activation")] = 1.0,
                      positions: Positions = None, targets: Targets = [], top_k: TopK = 10,
                      chat: Chat = False) -> s.EditResult:
        """Steer along a feature's decoder direction (its activation plus scale; the SAE's error term kept): baseline
        vs steered distributions. Feature edits also go into any tool's interventions as {'type': 'feature_steer' |
        'feature_ablate' | 'feature_clamp', 'sae': {'id': <sae id>}, 'feature': ..., 'scale' | 'value', ...}."""
        spec: dict[str, Any] = {"type": "feature_steer", "sae": {"id": sae_id}, "feature": feature, "scale": scale}
        if positions is not None:
            spec["positions"] = positions
        return self._compare(call, prompt, [spec], chat, top_k, targets)

    @tool
    def sae_train(self, call: Call, hook: Hook,
                  path: Annotated[str, Field(description="folder to save it to, inside the artifacts folder")],
                  d_sae: Annotated[int, Field(description="number of features")] = 4608,
                  k: Annotated[int, Field(description="active features per token (TopK)")] = 32,
                  hook_out: Annotated[str | None, Field(description="train a transcoder writing this point "
                                                                    "(e.g. blocks.3.hook_mlp_out)")] = None,
                  prompts: Annotated[list[ChatPrompt] | None, Field(description=(
                      f"training prompts, each a text {CONVERSATION}; omitted: prose shipped with Python "
                      f"(docstrings, help topics)"))] = None,
                  max_seconds: Annotated[float, Field(description="training time budget (the server caps it)")
                                         ] = 60.0,
                  batch_tokens: Annotated[int, Field(description="tokens per training step (the server caps it; "
                                                                 "a buffer of 64 prompts must hold that many)")] = 1024,
                  seed: Seed = 0) -> s.SaeTrained:
        """Train a TopK SAE (or transcoder) on a hook within a time budget; held-out figures (FVU, CE loss
        recovered, L0, dead features); saved in SAELens' format and kept in this session."""
        model = self.model(call)
        # every cheap argument checked before the corpus is built or anything computed
        if not 0 < max_seconds <= self.limits.max_train_seconds:
            raise WorkbenchError(f"max_seconds must be in (0, {self.limits.max_train_seconds}], got {max_seconds}")
        self._check_count("d_sae", d_sae, self.limits.max_sae_features)
        self._check_count("k", k, d_sae)
        self._check_count("batch_tokens", batch_tokens, self.limits.max_sae_batch_tokens)
        for point in (hook, hook_out) if hook_out is not None else (hook,):
            if hooks.resolve(point, model.config) != [point]:
                raise WorkbenchError(f"sae_train reads one hook point, not the pattern {shorten(point)}")
        probes.sae.check_save_folder(self.artifacts.path(path))
        folder = self.artifacts.target(path)
        corpus = self._prompt_list(call, prompts) if prompts is not None else probes.python_docs_corpus()
        if len(corpus) < 2:
            raise WorkbenchError("training needs at least two prompts (one is held out)")
        heldout = corpus[-max(1, len(corpus) // 20):][:64]
        train = corpus[:len(corpus) - len(heldout)]
        result = probes.train_sae(model, train, hook, d_sae=d_sae, k=k, hook_out=hook_out, max_seconds=max_seconds,
                                  heldout=heldout, seed=seed, buffer_prompts=64, batch_tokens=batch_tokens,
                                  progress=lambda done, total: call.check())
        result.sae.save(folder)
        return s.SaeTrained(sae=self._sae_info(call.session.put("sae", result.sae), result.sae),
                            summary=result.summary())

    # --------------------------------------------------------------------------------------- artifacts

    @tool
    def list_traces(self, call: Call) -> s.TraceList:
        """The traces this session holds (from run, the edit tools, attention_pattern, load_trace, replay_trace)."""
        return s.TraceList(traces=[self.trace_summary(call, i) for i in call.session.of_kind("trace")])

    @tool
    def save_trace(self, call: Call, trace_id: TraceId,
                   path: Annotated[str, Field(description="artifact folder to write, relative to the artifacts "
                                                          "folder")]) -> s.Saved:
        """Save a trace as an artifact (safetensors + hashed JSON manifest) inside the artifacts folder."""
        entry = call.session.entry("trace", trace_id)
        directory = entry.value.save(self.artifacts.target(path))
        entry.note["path"] = self.artifacts.relative(directory)
        return s.Saved(trace_id=trace_id, path=entry.note["path"],
                       bytes=sum(f.stat().st_size for f in directory.iterdir()))

    @tool
    def load_trace(self, call: Call,
                   path: Annotated[str, Field(description="a saved artifact, relative to the artifacts folder")]
                   ) -> s.TraceSummary:
        """Load a saved trace artifact (every hash verified) into this session."""
        trace = hooks.load_trace(self.artifacts.path(path), max_bytes=self.limits.max_session_bytes)
        summary = self._summarize(call, "", trace, path)  # all that can fail, before the trace is kept
        trace_id = call.session.put("trace", trace, path=path)
        return summary.model_copy(update={"trace_id": trace_id, "uri": f"trace://{trace_id}"})

    @tool
    def replay_trace(self, call: Call, trace_id: TraceId,
                     force: Annotated[bool, Field(description="replay even if the trace was recorded on another "
                                                              "model")] = False) -> s.Replay:
        """Re-run a trace's prompt and interventions on this session's model and compare every tensor with it. The
        trace's LoRA adapters must already be resident on the model (load_adapter), matched by sha256."""
        trace = call.session.get("trace", trace_id)
        model = self.model(call)
        # a saved trace may say anything: its replay is held to the limits of a direct call
        ids = self._check_cost(model, [trace.prompt], trace.chat, trace.interventions)[0]
        rows = [ids]
        if trace.batch:  # a batch run's trace recomputes its whole forward: every row, each with its interventions
            rows = trace.batch["rows"]
            self._check_count("rows of the trace's batched forward", len(rows), self.limits.max_batch)
            self._check_cost(model, rows)
            for specs in trace.batch["interventions"] or ():
                self._check_cost(model, specs=specs)
        self._record_names(model, list(trace.activations), sum(map(len, rows)))
        call.check()
        report = replay(trace, model, force=force, load_adapters=False)  # never a path a manifest names
        deviation = report.max_abs_deviation
        return s.Replay(trace_id=trace_id, verdict=report.verdict, worst_tensor=report.worst_tensor,
                        max_abs_deviation=deviation if deviation is None or math.isfinite(deviation) else None,
                        tensors_compared=report.tensors_compared, reason=report.reason,
                        model_forced=report.model_forced)

    @tool
    def compare_traces(self, call: Call, a: TraceId, b: TraceId) -> s.Comparison:
        """How two traces differ: next-token distributions, logits, and every activation both recorded."""
        return self._comparison(call, a, b)

    def _comparison(self, call: Call, a_id: str, b_id: str) -> s.Comparison:
        a, b = call.session.get("trace", a_id), call.session.get("trace", b_id)
        comparison = results.compare_traces(a, b, self.model(call), per_position=False)
        return s.Comparison(a=a_id, b=b_id, **comparison.to_dict())

    @tool
    def release(self, call: Call, ids: Annotated[list[str], Field(description="ids of traces, caches, probes, "
                                                                           "vectors")]) -> s.Released:
        """Free server-side objects of this session."""
        ids = list(dict.fromkeys(ids))  # an id given twice is released once
        unknown = [i for i in ids if i not in call.session.entries]
        if unknown:
            raise WorkbenchError(f"unknown ids {shorten(unknown)}; nothing released")
        for object_id in ids:
            call.session.release(object_id)
        return s.Released(released=ids)


def _shape_size(shape: str, n_tokens: int) -> int:
    dims = shape.strip("[]").split(",")
    return math.prod(n_tokens if d.strip() in ("T", "S") else int(d) for d in dims)


def _embedded_path() -> Path | None:
    from workbench.loading import default_model_path

    try:
        return default_model_path()
    except WorkbenchError:
        return None
