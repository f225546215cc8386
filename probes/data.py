"""Labelled prompt sets: the ones shipped in ``workbench.datasets`` by name, or a user's JSONL file.

Four kinds, told apart by the keys of each record (datasets/README.md documents the schema):

- classification: ``{"text": ..., "label": ...}`` with at least two labels;
- completion: ``{"text": ..., "answer": ...}``, the answer being the expected continuation;
- pairs: ``{"positive": ..., "negative": ...}``, contrastive prompts for steering;
- patching: ``{"clean": ..., "corrupt": ..., "clean_answer": ..., "corrupt_answer": ...}``, prompt pairs of one
  token count each for ``hooks.dataset_patching``.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from workbench.errors import WorkbenchError, shorten
from workbench.files import parse_json, regular_file
from workbench.messages import check_messages, is_messages

KINDS = {
    "classification": ("text", "label"),
    "completion": ("text", "answer"),
    "pairs": ("positive", "negative"),
    "patching": ("clean", "corrupt", "clean_answer", "corrupt_answer"),
}
# fields that may hold a conversation (a list of chat messages) instead of a text: the two sides' prompts
CONVERSATION_KEYS = ("positive", "negative", "clean", "corrupt")
# The shipped files: the repository's top-level datasets/ folder, installed as the data-only package
# workbench.datasets. It has no __init__.py, so that ``import datasets`` from the repository root finds Hugging Face's
# package, not this folder; and no importer reads it, since an editable install cannot import a package without one
# from a mapped folder. The installed layout mirrors the repository's (probes/ -> workbench/probes, datasets/ ->
# workbench/datasets), so it lies beside this package's folder in both.
SHIPPED = Path(__file__).resolve().parent.parent / "datasets"
# The two prompts of a record of the kinds that have two, their keys also their labels as a classification set.
SIDES = {"pairs": ("positive", "negative"), "patching": ("clean", "corrupt")}
DESCRIPTIONS = {
    "sentiment": "80 short reviews and remarks, 40 positive and 40 negative (classification)",
    "facts": "80 simple statements, 40 true and 40 false (classification)",
    "capitals": "50 'The capital of X is' prompts with the capital as answer (completion)",
    "happy_sad": "40 pairs of sentences differing in happy vs sad mood (pairs, for steering)",
    "ioi": "32 indirect-object sentences and their three-new-names twins, the answers the two names (patching)",
}


@dataclass(frozen=True)
class Dataset:
    name: str
    kind: str
    records: tuple[dict[str, Any], ...]
    description: str = ""

    def __post_init__(self) -> None:
        # a Dataset built directly is checked as a file is (kind, records, classes), before anything runs on it
        if self.kind not in KINDS:
            raise WorkbenchError(f"dataset {self.name!r}: kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not isinstance(self.records, tuple):
            object.__setattr__(self, "records", tuple(self.records))
        if not self.records:
            raise WorkbenchError(f"dataset {self.name!r} is empty")
        for number, record in enumerate(self.records, start=1):
            if not isinstance(record, dict):
                raise WorkbenchError(f"dataset {self.name!r} record {number}: a record must be a dict")
            _check_record(self.name, self.kind, number, record, "record")
        if self.kind == "classification":
            counts = {c: self.labels.count(c) for c in self.classes}
            if len(counts) < 2:
                raise WorkbenchError(f"dataset {self.name!r} has only one class ({next(iter(counts))!r}); "
                                     "a probe needs two or more")
            thin = [c for c, n in counts.items() if n < 2]
            if thin:
                raise WorkbenchError(f"dataset {self.name!r}: classes {thin} have fewer than 2 examples; "
                                     "a held-out split needs more")

    def __len__(self) -> int:
        return len(self.records)

    @property
    def prompts(self) -> list[str]:
        """Every prompt; for pairs, all positives then all negatives (patching: cleans then corrupts)."""
        if self.kind in SIDES:
            return [r[side] for side in SIDES[self.kind] for r in self.records]
        return [r["text"] for r in self.records]

    @property
    def labels(self) -> list[str]:
        """One label per prompt (pairs: "positive"/"negative"; patching: "clean"/"corrupt"; completion: the
        answer)."""
        if self.kind in SIDES:
            return [side for side in SIDES[self.kind] for _ in self.records]
        key = "label" if self.kind == "classification" else "answer"
        return [str(r[key]) for r in self.records]

    @property
    def groups(self) -> list[str]:
        """One group per prompt: prompts of a group stay on the same side of a train/test split.

        A record's optional ``"group"`` key (near-identical twins share one), each record on its own
        otherwise; the two sides of a pair are one group.
        """
        if self.kind in SIDES:
            return [str(i) for i in range(len(self.records))] * 2
        return [str(r.get("group", f"#{i}")) for i, r in enumerate(self.records)]

    @property
    def classes(self) -> list[str]:
        return sorted(set(self.labels))

    def contrast(self, positive: str | None = None) -> tuple[list[str], list[str]]:
        """(positive prompts, negative prompts) for a steering vector.

        Pairs give their two columns (patching: clean, corrupt). A two-class classification set gives the prompts
        of ``positive`` (default: the label "positive" or "true" when present) against those of the other class.
        """
        if self.kind in SIDES:
            sides = SIDES[self.kind]
            if positive is not None and positive != sides[0]:
                raise WorkbenchError(f"dataset {self.name!r} holds {self.kind}: its positive side is its {sides[0]!r} "
                                     f"column, not {shorten(positive)} (positive= chooses a class of two-class sets)")
            return tuple([r[side] for r in self.records] for side in sides)
        if self.kind != "classification" or len(self.classes) != 2:
            raise WorkbenchError(f"dataset {self.name!r} ({self.kind}, classes {self.classes[:5]}) cannot be split "
                                 "into a positive and a negative side: use a pairs dataset or a two-class one")
        if positive is None:
            positive = next((c for c in ("positive", "true") if c in self.classes), None)
            if positive is None:
                raise WorkbenchError(f"say which class of {self.classes} is the positive side (positive=...)")
        if positive not in self.classes:
            raise WorkbenchError(f"class {positive!r} is not in dataset {self.name!r}; classes: {self.classes}")
        pos = [p for p, l in zip(self.prompts, self.labels) if l == positive]
        neg = [p for p, l in zip(self.prompts, self.labels) if l != positive]
        return pos, neg

    def patching(self) -> tuple[list[tuple[Any, Any]], list[tuple[str, str]]]:
        """A patching dataset's ``(clean, corrupt)`` prompt pairs and their ``(clean answer, corrupt answer)``, as
        ``hooks.dataset_patching`` takes them."""
        if self.kind != "patching":
            raise WorkbenchError(f"dataset {self.name!r} is a {self.kind} dataset; patching takes one of clean and "
                                 "corrupt prompts with their answers")
        return ([(r["clean"], r["corrupt"]) for r in self.records],
                [(r["clean_answer"], r["corrupt_answer"]) for r in self.records])

    def sample(self, n: int, seed: int = 0) -> "Dataset":
        """A seeded subset of about ``n`` records with every class kept in equal share (for quick runs)."""
        if n <= 0:
            raise WorkbenchError(f"sample size must be positive, got {n}")
        rng = random.Random(seed)
        if self.kind != "classification":
            order = list(range(len(self.records)))
            rng.shuffle(order)
            chosen = sorted(order[:n])
        else:
            by_class: dict[str, list[int]] = {}
            for i, record in enumerate(self.records):
                by_class.setdefault(str(record["label"]), []).append(i)
            per_class = max(2, -(-n // len(by_class)))
            chosen = sorted(i for idx in by_class.values() for i in rng.sample(idx, min(per_class, len(idx))))
        return Dataset(self.name, self.kind, tuple(self.records[i] for i in chosen), self.description)


def list_datasets() -> dict[str, str]:
    """Names of the shipped datasets with a one-line description each."""
    return {name: DESCRIPTIONS.get(name, "") for name in sorted(_shipped())}


def load_dataset(name_or_path: str | Path | Dataset) -> Dataset:
    """A shipped dataset by name ("sentiment", "facts", "capitals", "happy_sad", "ioi") or a JSONL file."""
    if isinstance(name_or_path, Dataset):
        return name_or_path
    if not isinstance(name_or_path, (str, Path)):
        raise WorkbenchError(f"a dataset must be a shipped name, a JSONL path or a Dataset, got "
                             f"{type(name_or_path).__name__}")
    shipped = _shipped()
    if isinstance(name_or_path, str) and name_or_path in shipped:
        text = shipped[name_or_path].read_text(encoding="utf-8")
        return _parse(name_or_path, text, DESCRIPTIONS.get(name_or_path, ""))
    path = Path(name_or_path)
    if not path.is_file():
        raise WorkbenchError(f"no dataset {str(name_or_path)!r}: not a shipped name ({', '.join(sorted(shipped))}) "
                             "and not a file")
    try:
        text = regular_file(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise WorkbenchError(f"dataset {path} is not UTF-8 text (byte {err.start})") from None
    return _parse(path.stem, text, f"user file {path}")


def make_dataset(name: str, records: Sequence[dict[str, Any]]) -> Dataset:
    """A dataset from records in memory, validated like a file."""
    return _parse(name, "\n".join(json.dumps(r) for r in records), "")


def pairs_dataset(positive: Sequence[str], negative: Sequence[str], name: str = "pairs") -> Dataset:
    """A pairs dataset from two lists of prompts of equal length."""
    if isinstance(positive, str) or isinstance(negative, str):
        raise WorkbenchError("positive and negative prompts must be lists of texts or conversations")
    if len(positive) != len(negative):
        raise WorkbenchError(f"mismatched pair counts: {len(positive)} positive and {len(negative)} negative prompts")
    return make_dataset(name, [{"positive": p, "negative": n} for p, n in zip(positive, negative)])


def _shipped() -> dict[str, Path]:
    return {f.name.removesuffix(".jsonl"): f for f in SHIPPED.iterdir() if f.name.endswith(".jsonl")}



def _parse(name: str, text: str, description: str) -> Dataset:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = parse_json(line, f"dataset {name!r} line {number}")
        if not isinstance(record, dict):
            raise WorkbenchError(f"dataset {name!r} line {number}: a record must be a JSON object")
        records.append((number, record))
    if not records:
        raise WorkbenchError(f"dataset {name!r} is empty")
    kind = _kind_of(name, *records[0])
    for number, record in records:  # here, to name the file's line; the classes are checked by Dataset itself
        _check_record(name, kind, number, record)
    return Dataset(name, kind, tuple(r for _, r in records), description)


def _kind_of(name: str, number: int, record: dict) -> str:
    for kind, keys in KINDS.items():
        if all(k in record for k in keys):
            return kind
    if "positive" in record or "negative" in record:
        raise WorkbenchError(f"dataset {name!r} line {number}: mismatched pair counts: a pairs record needs both "
                             "'positive' and 'negative'")
    if "clean" in record or "corrupt" in record:
        *first, last = (repr(k) for k in KINDS["patching"])
        raise WorkbenchError(f"dataset {name!r} line {number}: a patching record needs {', '.join(first)} and {last}")
    raise WorkbenchError(f"dataset {name!r} line {number}: unknown record {sorted(record)}; expected keys "
                         + " or ".join(str(list(k)) for k in KINDS.values()))


def _check_record(name: str, kind: str, number: int, record: dict, where: str = "line") -> None:
    keys = KINDS[kind]
    missing = [k for k in keys if k not in record]
    if missing:
        hint = "mismatched pair counts: " if kind in SIDES else ""
        raise WorkbenchError(f"dataset {name!r} {where} {number}: {hint}missing {missing} (this is a {kind} dataset)")
    for key in keys:
        value = record[key]
        if key in CONVERSATION_KEYS and is_messages(value):
            try:
                check_messages(value)
            except WorkbenchError as err:
                raise WorkbenchError(f"dataset {name!r} {where} {number}: {key!r}: {err}") from None
            continue
        if not isinstance(value, str):
            raise WorkbenchError(f"dataset {name!r} {where} {number}: {key!r} must be a string, "
                                 f"got {type(value).__name__}")
        if not value.strip():
            raise WorkbenchError(f"dataset {name!r} {where} {number}: empty {key!r}")
