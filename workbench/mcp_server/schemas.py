"""Structured results of the MCP tools: each tool's output schema is one of these models.

The models of what ``workbench.results`` computes (distributions, comparisons, summaries) are derived from its
dataclasses, field descriptions included, so the schema and the numbers have one definition.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler, create_model
from pydantic_core import CoreSchema

from workbench import results

# Numbers that may be -inf (masked attention scores) travel as null.
Value = float | None


def _nullable_numbers(schema: Any) -> Any:
    """A JSON schema with every ``number`` also allowing null (nested models' own schemas are theirs to change)."""
    if isinstance(schema, list):
        return [_nullable_numbers(item) for item in schema]
    if not isinstance(schema, dict) or "$ref" in schema:
        return schema
    if schema.get("type") == "number":
        outer = {k: v for k, v in schema.items() if k in ("title", "description", "default")}
        inner = {k: v for k, v in schema.items() if k not in outer}
        return {"anyOf": [inner, {"type": "null"}], **outer}
    schema = {k: (v if k in ("title", "description", "default") else _nullable_numbers(v)) for k, v in schema.items()}
    if isinstance(schema.get("anyOf"), list):  # float | None: one null, not a null inside a null
        flat = [part for item in schema["anyOf"] for part in (item["anyOf"] if set(item) == {"anyOf"} else [item])]
        schema["anyOf"] = [part for i, part in enumerate(flat) if part not in flat[:i]]
    return schema


class Result(BaseModel):
    """A tool's result: any float in it may be NaN or infinite, which JSON carries as null, so the schema says so."""

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        schema = handler.resolve_ref_schema(handler(core_schema))
        schema.update(_nullable_numbers({k: v for k, v in schema.items() if k == "properties"}))
        return schema

_DERIVED: dict[type, type[BaseModel]] = {}  # results dataclass -> its model, for fields that nest one


def _model_type(annotation: Any) -> Any:
    """An annotation with every results dataclass in it replaced by its derived model."""
    if annotation in _DERIVED:
        return _DERIVED[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is None or not args:
        return annotation
    args = tuple(_model_type(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[args]
    return origin[args if len(args) > 1 else args[0]]


def derive(result: type, name: str | None = None, *, before: dict[str, Any] | None = None,
           exclude: tuple[str, ...] = (), descriptions: dict[str, str] | None = None) -> type[BaseModel]:
    """The model of a ``workbench.results`` dataclass: its fields (less ``exclude``) after the extra ``before`` ones
    (name -> (type, Field)), its docstring, the descriptions in its field metadata unless ``descriptions`` overrides
    one. Registered for nesting when it keeps the dataclass's name. A model built from ``result.to_dict()`` ignores
    the excluded keys."""
    hints = typing.get_type_hints(result)
    fields: dict[str, Any] = dict(before or {})
    for f in dataclasses.fields(result):
        if f.name not in exclude:
            description = (descriptions or {}).get(f.name, f.metadata.get("description"))
            fields[f.name] = (_model_type(hints[f.name]), Field(description=description))
    model = create_model(name or result.__name__, __base__=Result, __doc__=result.__doc__, __module__=__name__,
                         **fields)
    if name is None:
        _DERIVED[result] = model
    return model


TokenProb = derive(results.TokenProb)
Distribution = derive(results.Distribution)
TokenChange = derive(results.TokenChange)
HookDiff = derive(results.HookDiff)
ActivationSummary = derive(results.ActivationSummary, descriptions={
    "position_norms": "L2 norm at each token position (empty when recorded hooks x positions exceed the size limit)"})


class ModelInfo(Result):
    name: str
    path: str
    architecture: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    vocab_size: int
    n_ctx: int
    parameters: int
    device: str
    dtype: str
    tensor_formats: dict[str, int]
    numerics: str  # what this session's quantized matmuls compute: "exact" or "llamacpp"
    moe: dict[str, Any] | None = Field(None, description="a mixture-of-experts model's experts, routing and "
                                                         "shared expert (workbench.config.MoEConfig)")


class ModelEntry(Result):
    name: str
    path: str
    loaded: bool


class ModelList(Result):
    current: str = Field(description="the model this session's tools use")
    models: list[ModelEntry]


class LayerRouting(Result):
    layer: int
    experts: list[list[int]] = Field(description="per token, the chosen experts, best first")
    weights: list[list[float]] = Field(description="per token, the chosen experts' weights")
    load: list[float] = Field(description="per expert, the share of the tokens routed to it")


class MoERouting(Result):
    tokens: list[str]
    n_experts: int
    layers: list[LayerRouting]


class HookPoints(Result):
    n_layers: int
    block_points: dict[str, str] = Field(description="per-block suffix -> shape; full name blocks.{layer}.{suffix}")
    global_points: dict[str, str]
    matching: list[str] = Field(description="names matching the pattern, when one was given")


class Tokenization(Result):
    ids: list[int]
    tokens: list[str]


class RunResult(Result):
    trace_id: str
    tokens: list[str]
    next_token: Distribution
    recorded: list[ActivationSummary]


class PromptNextToken(Result):
    tokens: list[str]
    next_token: Distribution


class BatchRunResult(Result):
    results: list[PromptNextToken] = Field(description="one per prompt, in the prompts' order")


class ActivationSlice(Result):
    trace_id: str
    hook: str
    full_shape: list[int]
    shape: list[int] = Field(description="shape of the slice; values are row-major")
    positions: list[int]
    heads: list[int] | None
    features: list[int] = Field(description="[start, stop) of the feature axis, when it has one")
    values: list[Value]


EditResult = derive(results.NextTokenComparison, "EditResult", exclude=("baseline_top1",), before=dict(
    trace_id=(str, Field(description="trace of the edited run (save_trace / replay_trace take it)")),
    baseline_trace_id=(str, Field()),
    interventions=(list[dict[str, Any]], Field(description="as applied; long vectors shown as {size, norm}"))))


class Generation(Result):
    text: str
    ids: list[int]
    tokens: list[str]
    stopped: bool = Field(description="ended on an end-of-turn / end-of-text token")


class BatchGeneration(Result):
    generations: list[Generation] = Field(description="one per prompt, in the prompts' order")


class AttentionPattern(Result):
    trace_id: str
    layer: int
    heads: list[int]
    tokens: list[str]
    query_positions: list[int]
    pattern: list[list[list[float]]] = Field(description="[head][query][key] attention weights")


class KVInfo(Result):
    cache_id: str
    length: int
    next_position: int
    tokens: list[str]
    positions: list[int] = Field(description="rope position of each slot")


class KVCreated(KVInfo):
    next_token: Distribution


class KVLayer(Result):
    cache_id: str
    layer: int
    shape: list[int] = Field(description="[n_kv_heads, slots, d_head] of the slice")
    slots: list[int]
    keys: list[float]
    values: list[float]


class KVGeneration(KVInfo):
    generation: Generation


class TraceSummary(Result):
    trace_id: str
    uri: str = Field(description="the trace as an MCP resource")
    prompt: str | list[int] | list[dict[str, str]] = Field(description="text, ids, or a conversation of messages")
    tokens: list[str]
    next_token: Distribution | None = Field(description="at the last position (None: the trace kept no logits)")
    interventions: list[dict[str, Any]]
    recorded: dict[str, list[int]] = Field(description="hook -> shape")
    model: str = Field(description="model file the trace was recorded on")
    path: str | None = Field(description="artifacts file it was saved to or loaded from")


class TraceList(Result):
    traces: list[TraceSummary]


class Saved(Result):
    trace_id: str
    path: str = Field(description="path inside the artifacts folder")
    bytes: int


Comparison = derive(results.TraceComparison, "Comparison", before=dict(a=(str, Field()), b=(str, Field())),
                    exclude=("max_abs_deviation", "worst_tensor", "kl_per_position", "top1_changes"))


class Replay(Result):
    trace_id: str
    verdict: str = Field(description="'identical', 'within tolerance' or 'different'")
    max_abs_deviation: float | None = Field(description="largest |replayed - recorded| over logits and activations")
    worst_tensor: str | None
    tensors_compared: int
    reason: str | None = Field(description="why it is 'different' without a numeric comparison")
    model_forced: bool = Field(description="replayed on a model whose fingerprint differs (force=true)")


class PatchingSweep(Result):
    over: list[str] = Field(description="grid axes, e.g. ['layers', 'positions']")
    hook: str = Field(description="hook template, {layer} filled in per row")
    labels: dict[str, list[str]]
    grid: list[list[float]] | list[list[list[float]]]
    clean_metric: float
    corrupt_metric: float
    metric_name: str
    normalized: bool = Field(description="grid is (patched - corrupt) / (clean - corrupt)")
    method: str = Field(description="'activation patching' (each cell a patched run) or 'attribution patching' (each "
                                    "cell its first-order estimate from one backward)")
    pairs: int = Field(1, description="the prompt pairs whose grids and metrics are averaged (dataset_patching)")
    verified: list[VerifiedCell] = Field(default_factory=list, description=(
        "attribution's verify: the cells of the largest estimated effect, patched, largest first"))


class VerifiedCell(BaseModel):
    index: list[int] = Field(description="the cell's index in grid")
    labels: list[str]
    estimated: float = Field(description="the attribution estimate (as grid)")
    patched: float = Field(description="the activation-patched value (as grid)")


class PatchingPair(BaseModel):
    model_config = ConfigDict(extra="forbid")
    clean: str | list[dict[str, Any]] = Field(description="clean prompt: a text or a conversation")
    corrupt: str | list[dict[str, Any]] = Field(description="corrupt prompt, the clean one's number of tokens")
    answers: list[str] | None = Field(None, min_length=2, max_length=2, description=(
        "[clean answer, corrupt answer] single tokens, the metric their logit difference (default: each run's top "
        "token); for every pair or for none"))


class Released(Result):
    released: list[str]


class TokenP(Result):
    id: int
    token: str
    prob: float


class LensRow(Result):
    layer: int
    position: int
    top: list[TokenP]


class Lens(Result):
    tokens: list[str]
    point: str = Field(description="residual point read through the final norm and unembedding")
    positions: list[int]
    rows: list[LensRow] = Field(description="one per (layer, position), layers in order")


class TrackSeries(Result):
    token: str
    id: int
    position: int
    probs: list[float] = Field(description="probability at each layer")
    ranks: list[int] = Field(description="rank at each layer (0 = top)")
    first_top1_layer: int | None = Field(description="shallowest layer where it is the top prediction")


class TokenTrackResult(Result):
    tokens: list[str]
    point: str
    series: list[TrackSeries]


class Component(Result):
    label: str = Field(description="'embed', 'L3H5' (head 5 of layer 3) or 'L3 MLP'")
    kind: str
    contribution: float


class LayerAttribution(Result):
    layer: int
    attn: float = Field(description="sum over the layer's heads")
    mlp: float


class Attribution(Result):
    target: str
    position: int
    logit: float = Field(description="the model's logit (difference) at the position")
    total: float = Field(description="sum of all contributions")
    error: float = Field(description="|total - logit|")
    embed: float
    top: list[Component] = Field(description="largest |contribution| first")
    by_layer: list[LayerAttribution]


class DatasetInfo(Result):
    name: str = Field(description="a shipped name, or a .jsonl path inside the artifacts folder")
    kind: str = Field(description="classification, completion, pairs or patching")
    n_prompts: int
    description: str


class DatasetList(Result):
    datasets: list[DatasetInfo]
    skipped: list[str] = Field(default=[], description="files in the artifacts folder that are not readable "
                                                       "datasets, each with the reason")


class ProbeInfo(Result):
    probe_id: str
    hook: str
    pooling: str
    dataset: str
    classes: list[str]
    accuracy: float = Field(description="held-out accuracy")
    ci: list[float] = Field(description="95% Wilson interval of the accuracy")
    n_train: int
    n_test: int


class Prediction(Result):
    prompt: str | list[dict[str, Any]]
    label: str
    probs: dict[str, float]


class ProbePredictions(Result):
    probe_id: str
    predictions: list[Prediction]


class LayerAccuracy(Result):
    layer: int
    fraction: float = Field(description="depth fraction layer / (n_layers - 1)")
    accuracy: float
    ci: list[float]


class DepthSweepResult(Result):
    dataset: str
    point: str
    pooling: str
    n_examples: int
    layers: list[LayerAccuracy]
    peak_layer: int
    first_reaching_90: int = Field(description="shallowest layer reaching 90% of the peak accuracy")


class VectorInfo(Result):
    vector_id: str
    point: str
    layers: list[int]
    norms: list[float | None] = Field(description="norm of the direction at each layer (null if not finite)")
    source: str
    hooks: list[str]


class ExportedVector(Result):
    vector_id: str
    path: str
    bytes: int
    scale: float


class SaeInfo(Result):
    sae_id: str
    architecture: str
    hook: str = Field(description="the hook point it reads (its points are named under it: <hook>.hook_sae_acts_post)")
    hook_out: str = Field(description="the hook point it writes (a transcoder's output point; else its hook)")
    d_in: int
    d_sae: int = Field(description="number of features")
    k: int | None = None
    path: str | None = Field(default=None, description="where it was loaded from or saved to, in the artifacts folder")


class TokenFeatures(Result):
    position: int
    token: str
    features: list[list[float]] = Field(description="[feature, activation] pairs, strongest first")


class SaeFeatures(Result):
    sae_id: str
    tokens: list[TokenFeatures]


class FeatureExample(Result):
    activation: float
    prompt: int = Field(description="index of the prompt")
    position: int
    tokens: list[str] = Field(description="the context around the firing token")
    at: int = Field(description="index of the firing token in tokens")


class FeatureExamples(Result):
    sae_id: str
    feature: int
    density: float = Field(description="fraction of the prompts' tokens it fires on")
    examples: list[FeatureExample]
    promoted: list[list[Any]] = Field(description="[token, logit] the decoder direction promotes most (empty for "
                                                  "dictionaries that do not write the residual stream)")
    suppressed: list[list[Any]]


class SaeTrained(Result):
    sae: SaeInfo
    summary: dict[str, Any] = Field(description="steps, tokens, seconds, dead fraction and held-out figures (fvu, "
                                                "ce_recovered, l0, ...)")


class AdapterInfo(Result):
    name: str = Field(description="what calls name it by (compare_models' adapter)")
    path: str
    format: str = Field(description="'gguf' (llama.cpp) or 'peft'")
    sha256: str
    rank: int
    alpha: float | None
    scale: float = Field(description="the scale it is used at when named")
    layers: list[int] = Field(description="the layers it adapts")
    projections: list[str] = Field(description="the projections it adapts (wq, wk, wv, wo, w_gate, w_up, w_down)")
    parameters: int
    merged: str | None = Field(None, description="set for an adapter merged into the weights (no longer chosen per "
                                                 "call): what it was re-quantized to, e.g. 're-quantized to Q4_1'")


class AdapterList(Result):
    adapters: list[AdapterInfo]


class LensTokenChange(Result):
    token: str
    change: float = Field(description="mean change of its lens logit, adapter minus base")


class ModelComparison(Result):
    a: str = Field(description="what the first side ran with")
    b: str = Field(description="what the second side ran with ('base': no adapter)")
    prompts: int
    mean_kl: float = Field(description="KL(P_a || P_b) of the next-token distributions, mean over every position")
    max_kl: float
    kl_per_position: list[list[float]] = Field(description="per prompt, per position")
    resid_diff_norm: list[float] = Field(description="per layer: mean |resid_post_a - resid_post_b|")
    resid_diff_relative: list[float] = Field(description="per layer: the same over the mean |resid_post_b|")
    lens_promoted: list[list[LensTokenChange]] = Field(
        description="per layer: tokens the difference raises most (logit lens at the chosen position)")
    lens_suppressed: list[list[LensTokenChange]]
    attribution_target: str
    attribution_top: list[Component] = Field(description="components whose direct logit attribution to the target "
                                                          "changes most, a minus b")
    steering: VectorInfo = Field(description="the mean resid_post difference per layer, stored (steer with its id)")
