"""Linear probes on activations: where in depth does the model represent a label?

A probe is a 32-dim PCA followed by logistic regression (scikit-learn), fitted on pooled activations of
one hook point over a labelled dataset. Accuracy is measured on held-out prompts and reported with a
95% Wilson interval; splits are stratified, seeded, and keep a dataset's groups (a sentence and its
near-identical twin) on one side, so a probe is never tested on the twin of a training sentence.
Probes save as safetensors (the fitted arrays) + JSON (everything else); no pickle.

Depth fractions make results comparable across models of different depth: fraction ``f`` picks the
layer nearest to ``f * (n_layers - 1)``, halves rounding up (f=0 is the first layer, f=1 the last).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from workbench import hooks
from workbench.errors import WorkbenchError, integer, integer_list, number_list, real_number
from workbench.messages import Prompt

from .activations import Progress, block_hook, collect_activations
from .data import Dataset, load_dataset
from .saving import check_signature, model_signature, read_artifact, write_artifact

# scikit-learn (with scipy and pandas) takes ~1 s to import: it is imported where a probe is fitted or loaded, not
# by every ``import workbench.probes``
if TYPE_CHECKING:
    from sklearn.pipeline import Pipeline

FORMAT = "workbench-probe/1"

N_COMPONENTS = 32
Z_95 = 1.959963984540054


def wilson_interval(correct: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """95% Wilson score interval for a proportion ``correct / total``."""
    correct, total = integer(correct, "correct"), integer(total, "total")
    if total <= 0:
        raise WorkbenchError("an accuracy needs at least one test example")
    if not 0 <= correct <= total:
        raise WorkbenchError(f"correct must be in 0..total ({total}), got {correct}")
    p = correct / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    # the bounds are exactly 0 and 1 at the extremes; say so rather than return 0.9999999999999999
    low = 0.0 if correct == 0 else max(0.0, centre - half)
    high = 1.0 if correct == total else min(1.0, centre + half)
    return low, high


def layer_at_fraction(n_layers: int, fraction: float) -> int:
    """The layer nearest to ``fraction * (n_layers - 1)``, halves rounding up, with ``fraction`` read as the decimal it
    is written as (0.58 of 25 layers is 14.5, so 15, where the float 0.58 times 25 gives 14.499999999999998)."""
    try:
        number = real_number(fraction, "a depth fraction")  # numpy and 0-d torch numbers too
    except WorkbenchError:
        number = math.nan  # refused below, with the range in the message
    if not 0.0 <= number <= 1.0:
        raise WorkbenchError(f"a depth fraction must be a number in [0, 1], got {fraction!r}")
    return math.floor(Fraction(repr(number)) * (n_layers - 1) + Fraction(1, 2))


def _pipeline(n_features: int, n_train: int, n_components: int, seed: int) -> Pipeline:
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline

    # centred training data has rank <= n_train - 1; whitening keeps the regression well conditioned
    components = min(n_components, n_features, n_train - 1)
    return Pipeline([("pca", PCA(n_components=components, whiten=True, random_state=seed)),
                     ("logreg", LogisticRegression(max_iter=2000))])


@dataclass
class Probe:
    """A fitted probe at one hook point, with its held-out accuracy."""

    pipeline: Pipeline
    hook: str
    pooling: str
    signature: dict[str, Any]
    accuracy: float
    ci: tuple[float, float]
    n_train: int
    n_test: int
    dataset: str = ""

    @property
    def classes(self) -> list[str]:
        return [str(c) for c in self.pipeline.classes_]

    def check_model(self, model: Any) -> None:
        """Raise a clear error if ``model`` is not one this probe was fitted for."""
        check_signature(self.signature, model, "this probe")

    def features(self, model: Any, prompts: Sequence[Prompt], progress: Progress = None) -> np.ndarray:
        self.check_model(model)
        acts = collect_activations(model, prompts, [self.hook], self.pooling, progress)
        return acts[self.hook].numpy()

    def predict(self, model: Any, prompts: Sequence[Prompt], progress: Progress = None) -> list[str]:
        """The predicted class of each prompt."""
        return [str(c) for c in self.pipeline.predict(self.features(model, prompts, progress))]

    def predict_proba(self, model: Any, prompts: Sequence[Prompt], progress: Progress = None) -> torch.Tensor:
        """Class probabilities ``[prompts, classes]`` in the order of ``.classes``."""
        return torch.from_numpy(self.pipeline.predict_proba(self.features(model, prompts, progress)))

    def save(self, path: str | Path) -> tuple[Path, Path]:
        """Write ``path.safetensors`` (the fitted arrays) and ``path.json`` (hook, classes, model signature)."""
        pca, logreg = self.pipeline["pca"], self.pipeline["logreg"]
        tensors = {"pca_components": pca.components_, "pca_mean": pca.mean_,
                   "pca_explained_variance": pca.explained_variance_,
                   "coef": logreg.coef_, "intercept": logreg.intercept_}
        meta = {"format": FORMAT, "hook": self.hook, "pooling": self.pooling, "classes": self.classes,
                "signature": self.signature, "accuracy": self.accuracy, "ci": list(self.ci),
                "n_train": self.n_train, "n_test": self.n_test, "dataset": self.dataset}
        return write_artifact(path, {k: torch.from_numpy(np.asarray(v, dtype=np.float64)) for k, v in tensors.items()},
                              meta)

    @classmethod
    def load(cls, path: str | Path, model: Any | None = None) -> "Probe":
        """Read a saved probe (no pickle: the estimators are rebuilt from arrays); check it fits ``model``."""
        from sklearn.decomposition import PCA
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import Pipeline

        tensors, meta = read_artifact(path, "probe", FORMAT)
        arrays = {k: v.numpy() for k, v in tensors.items()}
        pca = PCA(n_components=arrays["pca_components"].shape[0], whiten=True)
        pca.components_, pca.mean_ = arrays["pca_components"], arrays["pca_mean"]
        pca.explained_variance_ = arrays["pca_explained_variance"]
        pca.n_components_, pca.n_features_in_ = pca.components_.shape
        logreg = LogisticRegression()
        logreg.coef_, logreg.intercept_ = arrays["coef"], arrays["intercept"]
        logreg.classes_ = np.array(meta["classes"])
        logreg.n_features_in_ = logreg.coef_.shape[1]
        probe = cls(Pipeline([("pca", pca), ("logreg", logreg)]), meta["hook"], meta["pooling"], meta["signature"],
                    meta["accuracy"], tuple(meta["ci"]), meta["n_train"], meta["n_test"], meta.get("dataset", ""))
        if model is not None:
            probe.check_model(model)
        return probe


def _folds(folds: int, labels: np.ndarray, groups: Sequence[str] | None, seed: int
           ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Stratified, seeded (train, test) folds that keep each group (e.g. a sentence and its twin) on one side, checked
    before any forward: enough examples of every class and enough groups for the folds, and every class on each
    training side."""
    counts = np.unique(labels, return_counts=True)[1]
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise WorkbenchError(f"folds must be an integer of at least 2 (a train and a test side), got {folds!r}")
    if counts.min() < folds:
        raise WorkbenchError(f"{folds} folds need at least {folds} examples of every class; "
                             f"the class sizes are {sorted(counts.tolist())}")
    from sklearn.model_selection import StratifiedGroupKFold

    groups = np.arange(len(labels)) if groups is None else np.asarray(groups)
    n_groups = len(np.unique(groups))
    if n_groups < folds:
        raise WorkbenchError(f"{folds} folds need at least {folds} groups of examples; the dataset's 'group' keys "
                             f"make {n_groups}")
    split = list(StratifiedGroupKFold(n_splits=folds, shuffle=True, random_state=seed).split(labels, labels, groups))
    for train, _ in split:
        missing = sorted(set(labels.tolist()) - set(labels[train].tolist()))
        if missing:
            raise WorkbenchError(f"class {missing[0]!r} lies in too few of the dataset's groups: a fold of {folds} "
                                 "would train without it (spread it over more groups, or use fewer folds)")
    return split


def _check_n_components(n_components: int) -> int:
    n = integer(n_components, "n_components")
    if n < 1:
        raise WorkbenchError(f"n_components must be at least 1, got {n}")
    return n


def _held_out_folds(test_size: float) -> int:
    """The number of folds whose one is the held-out share ``test_size`` (in (0, 0.5])."""
    share = real_number(test_size, "test_size")
    if not 0.0 < share <= 0.5:
        raise WorkbenchError(f"test_size must be in (0, 0.5], got {test_size}")
    return round(1 / share)


def fit_probe(features: np.ndarray | torch.Tensor, labels: Sequence[str], *, hook: str, pooling: str,
              signature: dict[str, Any], groups: Sequence[str] | None = None, test_size: float = 0.25, seed: int = 0,
              n_components: int = N_COMPONENTS, dataset: str = "") -> Probe:
    """Fit PCA + logistic regression on a stratified, seeded train split; score on the held-out rest.

    The held-out share is ``1 / round(1 / test_size)`` (one fold of a stratified group k-fold split).
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels)
    n_components = _check_n_components(n_components)
    train, test = _folds(_held_out_folds(test_size), y, groups, seed)[0]
    pipeline = _pipeline(x.shape[1], len(train), n_components, seed).fit(x[train], y[train])
    correct = int((pipeline.predict(x[test]) == y[test]).sum())
    return Probe(pipeline, hook, pooling, signature, correct / len(test), wilson_interval(correct, len(test)),
                 len(train), len(test), dataset)


def train_probe(model: Any, dataset: str | Path | Dataset, hook: str, pooling: str = "last", test_size: float = 0.25,
                seed: int = 0, n_components: int = N_COMPONENTS, progress: Progress = None) -> Probe:
    """Collect ``hook`` (one hook point) over a labelled dataset and fit a probe with a held-out split.

    Every class needs at least ``round(1 / test_size)`` examples (4 at the default 0.25; 2 at 0.5)."""
    data = load_dataset(dataset)
    names = hooks.resolve(hook, model.config)
    if len(names) != 1:  # a probe is fitted at one point; a pattern would silently take its first match
        raise WorkbenchError(f"{hook!r} matches {len(names)} hook points; a probe needs one "
                             "(depth_sweep probes many layers)")
    name = names[0]
    # every cheap check before the forwards
    _check_n_components(n_components)
    _folds(_held_out_folds(test_size), np.asarray(data.labels), data.groups, seed)
    acts = collect_activations(model, data.prompts, [name], pooling, progress)
    return fit_probe(acts[name], data.labels, hook=name, pooling=pooling, signature=model_signature(model, name),
                     groups=data.groups, test_size=test_size, seed=seed, n_components=n_components, dataset=data.name)


def probe_at_depth_fraction(model: Any, dataset: str | Path | Dataset, fraction: float, point: str = "resid_post",
                            pooling: str = "last", test_size: float = 0.25, seed: int = 0,
                            progress: Progress = None) -> Probe:
    """A 32-dim PCA + logistic-regression probe at the layer nearest ``fraction`` of the depth (see module doc)."""
    layer = layer_at_fraction(model.config.n_layers, fraction)
    return train_probe(model, dataset, block_hook(model, layer, point), pooling, test_size, seed, progress=progress)


@dataclass
class DepthSweep:
    """Probe accuracy per layer with 95% Wilson intervals.

    Each example is predicted once, by a probe fitted on the other folds of a stratified, seeded
    group k-fold split (groups keep near-identical twins out of each other's test fold).
    """

    dataset: str
    point: str
    pooling: str
    n_layers: int
    layers: list[int]
    accuracy: dict[int, float]
    ci: dict[int, tuple[float, float]]
    n_examples: int
    features: dict[int, torch.Tensor] = field(repr=False)  # the pooled activations, reusable for probes
    labels: list[str] = field(repr=False)
    groups: list[str] = field(repr=False)
    hooks: dict[int, str] = field(repr=False)
    signature: dict[str, Any] = field(repr=False)  # of the first layer's hook; the others differ only in name

    def fraction(self, layer: int) -> float:
        return layer / max(1, self.n_layers - 1)

    @property
    def peak_layer(self) -> int:
        """The layer with the highest accuracy (the shallowest one on ties)."""
        return max(self.layers, key=lambda l: (self.accuracy[l], -l))

    def first_reaching(self, share: float = 0.9) -> int:
        """The shallowest layer whose accuracy reaches ``share`` of the peak accuracy."""
        if not 0.0 <= share <= 1.0:
            raise WorkbenchError(f"share must be in [0, 1], got {share}")
        goal = share * self.accuracy[self.peak_layer]
        return next(l for l in self.layers if self.accuracy[l] >= goal)

    def probe(self, layer: int, test_size: float = 0.25, seed: int = 0) -> Probe:
        """A probe at one of the swept layers, fitted on the cached activations (no new forward)."""
        if layer not in self.features:
            raise WorkbenchError(f"layer {layer} was not swept; swept layers: {self.layers}")
        hook = self.hooks[layer]
        return fit_probe(self.features[layer], self.labels, hook=hook, pooling=self.pooling,
                         signature=dict(self.signature, hook=hook),
                         groups=self.groups, test_size=test_size, seed=seed, dataset=self.dataset)

    def figure(self):
        """Accuracy across depth with its 95% interval as a band; the peak marked."""
        import plotly.graph_objects as go

        acc = [self.accuracy[l] for l in self.layers]
        low = [self.ci[l][0] for l in self.layers]
        high = [self.ci[l][1] for l in self.layers]
        fig = go.Figure([
            go.Scatter(x=self.layers + self.layers[::-1], y=high + low[::-1], fill="toself", line_width=0,
                       fillcolor="rgba(31,119,180,0.2)", hoverinfo="skip", name="95% interval"),
            go.Scatter(x=self.layers, y=acc, mode="lines+markers", name="accuracy",
                       customdata=[self.fraction(l) for l in self.layers],
                       hovertemplate="layer %{x} (depth %{customdata:.2f}): %{y:.3f}<extra></extra>"),
        ])
        fig.add_vline(x=self.peak_layer, line_dash="dot", annotation_text=f"peak L{self.peak_layer}")
        fig.update_layout(title=f"Probe accuracy across depth: {self.dataset} ({self.point}, {self.pooling} token, "
                                f"n={self.n_examples})", xaxis_title="layer", yaxis_title="accuracy",
                          yaxis_range=[0, 1.02], template="plotly_white")
        return fig


def depth_sweep(model: Any, dataset: str | Path | Dataset = "sentiment", fractions: Sequence[float] | None = None,
                layers: Sequence[int] | None = None, point: str = "resid_post", pooling: str = "last",
                folds: int = 5, seed: int = 0, n_components: int = N_COMPONENTS,
                progress: Progress = None) -> DepthSweep:
    """Probe accuracy at every layer (or the given layers, or the layers at the given depth fractions).

    Every layer's activations come from the same forwards: one per prompt, recording all of them at once.
    """
    from sklearn.model_selection import cross_val_predict

    data = load_dataset(dataset)
    n_layers = model.config.n_layers
    n_components = _check_n_components(n_components)
    if fractions is not None and layers is not None:
        raise WorkbenchError("give fractions or layers, not both")
    if fractions is not None:
        chosen = [layer_at_fraction(n_layers, f) for f in number_list(fractions, "fractions")]
    else:  # a float layer (1.7) is refused rather than floored
        chosen = list(range(n_layers)) if layers is None else integer_list(layers, "layers")
    if not chosen:
        raise WorkbenchError("no layers to sweep")
    chosen = sorted(set(chosen))
    names = [block_hook(model, layer, point) for layer in chosen]
    labels = np.asarray(data.labels)
    folds_of = _folds(folds, labels, data.groups, seed)
    n_train = min(len(train) for train, _ in folds_of)
    acts = collect_activations(model, data.prompts, names, pooling, progress)
    accuracy, ci = {}, {}
    for layer, name in zip(chosen, names):
        x = acts[name].double().numpy()
        predicted = cross_val_predict(_pipeline(x.shape[1], n_train, n_components, seed), x, labels, cv=folds_of)
        correct = int((predicted == labels).sum())
        accuracy[layer] = correct / len(labels)
        ci[layer] = wilson_interval(correct, len(labels))
    return DepthSweep(data.name, point.removeprefix("hook_"), pooling, n_layers, chosen, accuracy, ci, len(labels),
                      {layer: acts[name] for layer, name in zip(chosen, names)}, list(data.labels), data.groups,
                      dict(zip(chosen, names)), model_signature(model, names[0]))
