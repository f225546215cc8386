"""Training small sparse dictionaries on a model's activations: TopK SAEs and TopK transcoders (Gao et al. 2024,
"Scaling and evaluating sparse autoencoders"), and the figures that say how good one is.

Activations stream from batched runs (``model.iter_batch`` with ``record``) into a shuffled buffer; inputs are scaled
so that their mean squared norm is ``d_in`` while training, and the scale is folded into the weights when saved, so
the file reads the model's own activations (SAELens' "expected_average_only_in", folded). Dead features (none fired
in the last ``dead_tokens`` tokens) are trained to reconstruct the live features' residual (AuxK loss). The first
token of every prompt (an attention sink with an outsized residual) is left out of training and of the figures.

Corpora (``python_docs_corpus``, ``generated_corpus``) are made on the machine: nothing large ships with the workbench.
"""
from __future__ import annotations

import ast
import json
import math
import random
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from workbench.errors import WorkbenchError
from workbench.progress import Progress, progress_callback

from .activations import check_prompts
from .sae import ARCHITECTURES, SAE


def init_sae(architecture: str, d_in: int, d_sae: int, hook: str, *, k: int | None = None,
             hook_out: str | None = None, d_out: int | None = None, seed: int = 0, scale: float = 1.0) -> SAE:
    """A random SAE of any architecture: unit-norm decoder rows, the encoder their transpose (Gao et al.'s
    initialisation), small random biases (zero for a SAE about to be trained: ``scale=0``)."""
    if architecture not in ARCHITECTURES:
        raise WorkbenchError(f"unknown SAE architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")
    activation, transcoder, skip = ARCHITECTURES[architecture]
    d_out = d_out or d_in
    g = torch.Generator().manual_seed(seed)
    w_dec = torch.randn(d_sae, d_out, generator=g)
    w_dec /= w_dec.norm(dim=-1, keepdim=True)
    w_enc = w_dec.T.clone() if d_out == d_in else torch.randn(d_in, d_sae, generator=g) / math.sqrt(d_in)
    params = {"W_enc": w_enc.contiguous(), "W_dec": w_dec, "b_dec": torch.randn(d_out, generator=g) * 0.1 * scale}
    if activation == "gated":
        params.update(b_gate=torch.randn(d_sae, generator=g) * 0.1 * scale, b_mag=torch.randn(d_sae, generator=g)
                      * 0.1 * scale, r_mag=torch.randn(d_sae, generator=g) * 0.1 * scale)
    else:
        params["b_enc"] = torch.randn(d_sae, generator=g) * 0.1 * scale
    if activation == "jumprelu":
        params["threshold"] = torch.rand(d_sae, generator=g) * 0.2 * scale
    if skip:
        params["W_skip"] = torch.randn(d_out, d_in, generator=g) * 0.1 * scale
    return SAE(architecture, params, hook, hook_out=hook_out if transcoder else None, k=k)


# ------------------------------------------------------------------------------------------------ corpora


def python_docs_corpus(min_chars: int = 200, max_chars: int = 2000) -> list[str]:
    """English prose shipped with Python itself (PSF license): the docstrings of the standard library's modules,
    classes and functions, and pydoc's help topics, cut into paragraphs-aligned pieces of at most ``max_chars``.
    Read from the installed standard library (no download); about 1.8 M characters (about 0.45 M tokens)."""
    from pydoc_data import topics

    texts = list(topics.topics.values())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for file in sorted(stdlib.rglob("*.py")):
        if {"test", "tests", "site-packages", "idlelib"} & set(file.relative_to(stdlib).parts):
            continue
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    pieces = []
    for text in texts:
        piece = ""
        for paragraph in text.split("\n\n"):
            if piece and len(piece) + len(paragraph) > max_chars:
                pieces.append(piece)
                piece = ""
            piece = f"{piece}\n\n{paragraph}" if piece else paragraph
        pieces.append(piece[:max_chars])
    return [p for p in pieces if len(p) >= min_chars]


SEED_PROMPTS = (
    "The history of", "In a small village", "The recipe calls for", "Scientists have discovered", "def main():",
    "Dear Sir or Madam,", "Once upon a time", "The stock market", "To install the package,", "Chapter 1.",
    "The patient presented with", "import numpy as np", "The best way to learn", "Breaking news:", "In mathematics,",
    "The weather today", "My favourite book is", "According to the report,", "The rules of chess", "Photosynthesis is",
    "The following table shows", "Q: What is", "The city council voted", "Abstract. We propose", "Step 1:",
    "The river flows", "She opened the door and", "A brief guide to", "The law states that", "In 1969,",
)


def generated_corpus(model: Any, n_texts: int, cache: str | Path | None = None, *, max_new_tokens: int = 96,
                     temperature: float = 1.0, top_p: float = 0.95, seed: int = 0, batch_size: int | None = 32,
                     seeds: Sequence[str] = SEED_PROMPTS, progress: Progress = False) -> list[str]:
    """``n_texts`` texts the model writes itself from varied seed prompts (sampled, in batches), each its seed plus
    its continuation; cached as JSON lines in ``cache`` (read back when it holds as many texts from this model)."""
    if cache is not None and Path(cache).is_file():
        rows = [json.loads(line) for line in Path(cache).read_text().splitlines() if line.strip()]
        if len(rows) >= n_texts and all(r.get("model") == model.file_sha256 for r in rows[:n_texts]):
            return [r["text"] for r in rows[:n_texts]]
    prompts = [seeds[i % len(seeds)] for i in range(n_texts)]
    texts = [""] * n_texts
    update, close = progress_callback(progress, n_texts, "texts")
    done = 0
    try:
        step = batch_size or n_texts
        for start in range(0, n_texts, step):
            part = prompts[start:start + step]
            # each batch its own seed, so that texts from one seed prompt differ
            outs = model.generate_batch(part, max_new_tokens, temperature=temperature, top_p=top_p,
                                        seed=seed + start, batch_size=batch_size)
            for i, out in enumerate(outs):
                texts[start + i] = part[i] + out
            done += len(part)
            update(done)
    finally:
        close()
    if cache is not None:
        Path(cache).write_text("".join(json.dumps({"model": model.file_sha256, "text": t}) + "\n" for t in texts))
    return texts


# ----------------------------------------------------------------------------------------------- training


def _activations(model: Any, prompts: Sequence[Any], hooks: Sequence[str], batch_size: int | None
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input, target) activations of each prompt, its first token left out; an SAE's target is its input."""
    for _, trace in model.iter_batch(list(prompts), record=list(dict.fromkeys(hooks)), logits=None,
                                     batch_size=batch_size, record_device=model.device):
        x = trace.activations[hooks[0]][1:]
        yield x, trace.activations[hooks[-1]][1:] if hooks[-1] != hooks[0] else x


@dataclass
class TrainResult:
    """A trained dictionary and how the training went (``evaluation``: ``evaluate_sae`` on the held-out prompts)."""

    sae: SAE
    steps: int
    tokens: int  # training tokens seen (a token seen twice counts twice)
    seconds: float
    dead_fraction: float  # features that fired on none of the last ``dead_tokens`` training tokens
    history: list[dict[str, float]] = field(default_factory=list)
    evaluation: dict[str, float] | None = None

    def summary(self) -> dict[str, Any]:
        return {"architecture": self.sae.architecture, "hook": self.sae.hook, "hook_out": self.sae.hook_out,
                "d_in": self.sae.d_in, "d_sae": self.sae.d_sae, "k": self.sae.k, "steps": self.steps,
                "tokens": self.tokens, "seconds": round(self.seconds, 2), "dead_fraction": self.dead_fraction,
                "heldout": self.evaluation}


def train_sae(model: Any, prompts: Sequence[Any], hook: str, *, d_sae: int, k: int = 32, hook_out: str | None = None,
              tokens: int | None = None, max_seconds: float | None = None, batch_tokens: int = 1024,
              buffer_prompts: int = 256, lr: float | None = None, aux_k_coefficient: float = 1 / 32,
              dead_tokens: int = 50_000, heldout: Sequence[Any] = (), checkpoint_dir: str | Path | None = None,
              checkpoint_every: int = 500, batch_size: int | None = None, progress: Progress = False,
              seed: int = 0) -> TrainResult:
    """Train a TopK SAE on ``hook`` (a TopK transcoder from ``hook`` to ``hook_out`` when given) over ``prompts``.

    Training runs until ``tokens`` training tokens or ``max_seconds`` (activation runs included), whichever comes
    first (with neither: one pass over the prompts), in steps of ``batch_tokens`` drawn from a shuffled buffer of
    ``buffer_prompts`` prompts' activations. ``lr`` defaults to Gao et al.'s 2e-4 scaled by ``sqrt(16384 / d_sae)``.
    Every ``checkpoint_every`` steps, and at the end, the SAE is saved to ``checkpoint_dir/step_<n>`` (and
    ``checkpoint_dir/final``). With ``heldout`` prompts, the result carries ``evaluate_sae`` of them."""
    started = time.perf_counter()
    hooks_in_out = [hook, hook_out or hook]
    prompts = check_prompts(prompts)
    heldout = _evaluation_prompts(model, heldout) if heldout else []  # refused before training, not after it
    for value, what in ((d_sae, "d_sae"), (k, "k"), (batch_tokens, "batch_tokens"), (buffer_prompts, "buffer_prompts"),
                        (dead_tokens, "dead_tokens"), (checkpoint_every, "checkpoint_every")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise WorkbenchError(f"{what} must be a positive integer, got {value!r}")
    if k > d_sae:
        raise WorkbenchError(f"k ({k}) cannot exceed d_sae ({d_sae})")
    from workbench import hooks as hooks_lib

    widths = [hooks_lib.points.feature_size(h, model.config) for h in hooks_lib.resolve(hook, model.config)
              + (hooks_lib.resolve(hook_out, model.config) if hook_out else [])]
    if None in widths:
        raise WorkbenchError(f"an SAE reads one vector a token; {hook_out if widths[0] else hook} has no fixed width")
    architecture = "topk_transcoder" if hook_out else "topk"
    sae = init_sae(architecture, widths[0], d_sae, hook, k=k, hook_out=hook_out, d_out=widths[-1], seed=seed,
                   scale=0.0)
    hooks_lib.check_saes([sae], model.config)

    rng = random.Random(seed)
    order = list(range(len(prompts)))
    budget = tokens
    # progress in tokens against a token budget, else in seconds against the time budget
    by_time = budget is None and max_seconds is not None
    lr = lr if lr is not None else 2e-4 * math.sqrt(16384 / d_sae)
    trainer = _Trainer(sae.on(model.device), lr, aux_k_coefficient, dead_tokens)
    history: list[dict[str, float]] = []
    update, close = progress_callback(progress, int(max_seconds) if by_time else (budget or 0),
                                      "seconds" if by_time else "tokens")
    seen, step = 0, 0

    def stop() -> bool:
        """Progress reported (a callback may cancel here) and whether a budget is spent."""
        elapsed = time.perf_counter() - started
        if by_time:
            update(min(int(elapsed), int(max_seconds)))
        elif budget:
            update(seen)
        return (budget is not None and seen >= budget) or (max_seconds is not None and elapsed >= max_seconds)

    try:
        while True:
            rng.shuffle(order)
            steps_before, largest = step, 0
            for start in range(0, len(order), buffer_prompts):
                group = [prompts[i] for i in order[start:start + buffer_prompts]]
                pairs = list(_activations(model, group, hooks_in_out, batch_size))
                x = torch.cat([p[0] for p in pairs]).float()
                y = torch.cat([p[1] for p in pairs]).float()
                largest = max(largest, x.shape[0])
                if trainer.scale_in is None:  # b_dec starts at the data's mean, as Gao et al.'s does (its median)
                    trainer.start(x, y)
                perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed + step)).to(x.device)
                for i in range(0, x.shape[0] - batch_tokens + 1, batch_tokens):
                    rows = perm[i:i + batch_tokens]
                    metrics = trainer.step(x[rows], y[rows])
                    seen += len(rows)
                    step += 1
                    history.append({"step": step, "tokens": seen, **metrics})
                    if checkpoint_dir is not None and step % checkpoint_every == 0:
                        trainer.folded().save(Path(checkpoint_dir) / f"step_{step}")
                    if stop():
                        raise _Done
                if stop():  # a buffer too small for a step still counts against the budgets
                    raise _Done
            if step == steps_before:  # a pass without a step ends training: it must always end
                if step == 0:
                    raise WorkbenchError(f"batch_tokens ({batch_tokens}) is more than any buffer of the prompts "
                                         f"holds ({largest} tokens): give more or longer prompts, or a smaller "
                                         "batch_tokens")
                raise _Done
            if budget is None and max_seconds is None:
                raise _Done
    except _Done:
        pass
    finally:
        close()
    trained = trainer.folded()
    if checkpoint_dir is not None:
        trained.save(Path(checkpoint_dir) / "final")
    seconds = time.perf_counter() - started
    result = TrainResult(trained, step, seen, seconds, trainer.dead_fraction(), history)
    if heldout:
        result.evaluation = evaluate_sae(model, trained, heldout, batch_size=batch_size)
    return result


class _Done(Exception):
    pass


class _Trainer:
    """Adam on a TopK dictionary's weights, in the normalized scale; the decoder rows kept at unit norm."""

    def __init__(self, sae: SAE, lr: float, aux_k_coefficient: float, dead_tokens: int):
        self.sae, self.lr, self.aux_k_coefficient, self.dead_tokens = sae, lr, aux_k_coefficient, dead_tokens
        self.params = {n: sae.params[n].clone().float().requires_grad_(True) for n in ("W_enc", "b_enc", "W_dec",
                                                                                       "b_dec")}
        self.optimizer = torch.optim.Adam(self.params.values(), lr=lr, betas=(0.9, 0.999))
        self.since_fired = torch.zeros(sae.d_sae, dtype=torch.long, device=sae.device)
        self.scale_in: float | None = None
        self.scale_out: float | None = None

    def start(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.scale_in = math.sqrt(x.shape[1] / x.pow(2).sum(-1).mean().item())
        self.scale_out = math.sqrt(y.shape[1] / y.pow(2).sum(-1).mean().item()) if y is not x else self.scale_in
        with torch.no_grad():
            self.params["b_dec"].copy_((y * self.scale_out).mean(0))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        p, sae = self.params, self.sae
        x, y = x * self.scale_in, y * self.scale_out
        centered = x - p["b_dec"] if sae.apply_b_dec_to_input else x
        pre = centered @ p["W_enc"] + p["b_enc"]
        values, indices = pre.topk(sae.k, dim=-1, sorted=False)
        acts = torch.zeros_like(pre).scatter(-1, indices, values.relu())
        recons = acts @ p["W_dec"] + p["b_dec"]
        residual = y - recons
        mse = residual.pow(2).sum(-1).mean()
        with torch.no_grad():
            fired = torch.zeros(sae.d_sae, dtype=torch.bool, device=pre.device)
            fired[indices[values > 0]] = True
            self.since_fired = torch.where(fired, 0, self.since_fired + x.shape[0])
            dead = self.since_fired >= self.dead_tokens
        loss = mse
        aux = torch.zeros((), device=pre.device)
        n_dead = int(dead.sum())
        if n_dead and self.aux_k_coefficient:
            k_aux = min(y.shape[1] // 2, n_dead)
            dead_pre = torch.where(dead, pre, -torch.inf)
            aux_values, aux_indices = dead_pre.topk(k_aux, dim=-1, sorted=False)
            aux_acts = torch.zeros_like(pre).scatter(-1, aux_indices, aux_values.relu())
            aux = (aux_acts @ p["W_dec"] - residual.detach()).pow(2).sum(-1).mean()
            loss = loss + self.aux_k_coefficient * min(n_dead / k_aux, 1.0) * aux
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            p["W_dec"] /= p["W_dec"].norm(dim=-1, keepdim=True).clamp(min=1e-8)
            variance = (y - y.mean(0)).pow(2).sum(-1).mean()
        return {"mse": float(mse.detach()), "fvu": float(mse.detach() / variance), "aux": float(aux.detach()),
                "dead": n_dead / sae.d_sae}

    def dead_fraction(self) -> float:
        return float((self.since_fired >= self.dead_tokens).float().mean())

    def folded(self) -> SAE:
        """The SAE reading and writing the model's own scale: the input scale folded into W_enc, the output's into
        W_dec and b_dec."""
        p = {n: v.detach().cpu().clone() for n, v in self.params.items()}
        scale_in, scale_out = self.scale_in or 1.0, self.scale_out or 1.0
        # an SAE's scales are one: (x s - b) W = (x - b / s) (s W), and (a W + b) / s = a (W / s) + b / s
        p["W_enc"] *= scale_in
        p["W_dec"] /= scale_out
        p["b_dec"] /= scale_out
        sae = self.sae
        trained = SAE(sae.architecture, p, sae.hook, hook_out=sae.hook_out, k=sae.k,
                      apply_b_dec_to_input=sae.apply_b_dec_to_input, normalize_activations="none",
                      cfg={"metadata": {"model_name": None}})
        return trained


# --------------------------------------------------------------------------------------------- evaluation


def evaluate_sae(model: Any, sae: SAE, prompts: Sequence[Any], batch_size: int | None = None) -> dict[str, float]:
    """How well ``sae`` stands in for the activation it reads, over ``prompts`` (first tokens left out):

    - ``fvu``: fraction of variance unexplained, sum |y - sae(x)|^2 / sum |y - mean(y)|^2;
    - ``ce_loss_clean``, ``ce_loss_spliced`` (the reconstruction in place of the activation at every position but
      the first), ``ce_loss_ablated`` (zeros there), and ``ce_recovered`` = (ablated - spliced) / (ablated - clean):
      mean next-token cross-entropy in nats;
    - ``l0`` (mean active features a token), ``dead_fraction`` (features active on no token here), ``tokens``."""
    from workbench import hooks as hooks_lib

    hooks_lib.check_saes([sae], model.config)
    sae = sae.on(model.device)
    prompts = _evaluation_prompts(model, prompts)
    hooks_in_out = [sae.hook, sae.hook_out]
    residual = total = l0 = 0.0
    sum_y = sum_y2 = None
    fired = torch.zeros(sae.d_sae, dtype=torch.bool)
    n = 0
    with torch.no_grad():
        for x, y in _activations(model, prompts, hooks_in_out, batch_size):
            acts, out = sae.forward(x)
            x, y, out = x.float().cpu(), y.float().cpu(), out.float().cpu()
            residual += float((y - out).pow(2).sum())
            sum_y = y.sum(0) if sum_y is None else sum_y + y.sum(0)
            sum_y2 = float(y.pow(2).sum()) + (sum_y2 or 0.0)
            active = acts != 0
            l0 += float(active.sum())
            fired |= active.any(0).cpu()
            n += x.shape[0]
    total = sum_y2 - float(sum_y.pow(2).sum()) / n
    if total <= 1e-6 * sum_y2:  # no variance but float32's rounding of the sums
        raise WorkbenchError(f"the activation at {sae.hook_out} does not vary over these {n} tokens: its fraction of "
                             "variance unexplained is undefined (give more or other prompts)")

    def splice(replace):
        """A hook that puts ``replace(x, ctx)`` at every position but the first."""
        def fn(x: torch.Tensor, ctx) -> torch.Tensor:
            rows = ctx.positions > 0
            out = x.clone()
            out[rows] = replace(x, ctx)[rows].to(x.dtype)
            return out
        return fn

    if sae.is_transcoder:
        stash: list[torch.Tensor] = []

        def keep(x: torch.Tensor, ctx) -> None:
            stash[:] = [x]

        spliced = [hooks_lib.FunctionHook(sae.hook, keep),
                   hooks_lib.FunctionHook(sae.hook_out, splice(lambda x, ctx: sae(stash[0])))]
    else:
        spliced = [hooks_lib.FunctionHook(sae.hook, splice(lambda x, ctx: sae(x)))]
    ablated = [hooks_lib.FunctionHook(sae.hook_out, splice(lambda x, ctx: torch.zeros_like(x)))]
    losses = [_ce_loss(model, prompts, interventions, batch_size) for interventions in ([], spliced, ablated)]
    clean, spliced_loss, ablated_loss = losses
    return {"fvu": residual / total, "ce_loss_clean": clean, "ce_loss_spliced": spliced_loss,
            "ce_loss_ablated": ablated_loss,
            "ce_recovered": (ablated_loss - spliced_loss) / (ablated_loss - clean) if ablated_loss != clean else 1.0,
            "l0": l0 / n, "dead_fraction": float((~fired).float().mean()), "tokens": n}


def _evaluation_prompts(model: Any, prompts: Sequence[Any]) -> list[list[int]]:
    """``evaluate_sae``'s prompts as token ids (tokenized once, for every run it makes), checked before any compute:
    its cross-entropies count predictions from token 2."""
    ids = model.batch_ids(check_prompts(prompts))
    if all(len(row) < 3 for row in ids):
        raise WorkbenchError("evaluating an SAE needs a prompt of at least three tokens")
    return ids


def _ce_loss(model: Any, prompts: Sequence[Any], interventions: list, batch_size: int | None) -> float:
    """Mean next-token cross-entropy (nats) over every prompt's predictions of its tokens after the second."""
    total, count = 0.0, 0
    for _, trace in model.iter_batch(prompts, interventions=interventions, batch_size=batch_size):
        ids = torch.tensor(trace.ids)
        # the prediction of token 1 comes from position 0, which the splice leaves alone: it is not counted
        logits = trace.logits[1:-1]
        total += float(torch.nn.functional.cross_entropy(logits.float(), ids[2:], reduction="sum"))
        count += len(ids) - 2
    return total / max(count, 1)
