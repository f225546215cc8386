"""What every page of the dashboard shares: the cached model, the session's prompt, the error guard,
per-session memoisation, token chips and the plot helpers.

Pages reach the model only through the public API (``workbench.load``, ``Model.run`` / ``forward`` /
``stream`` / ``new_cache``, ``workbench.hooks``, ``workbench.probes``), exactly as a notebook would.
"""
from __future__ import annotations

import argparse
import html
import io
import logging
import sys
import tempfile
import zipfile
import zlib
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import plotly.graph_objects as go
import streamlit as st

import workbench
from workbench import results
from workbench.errors import WorkbenchError, shorten
from workbench.hooks.trace import MANIFEST_FILE, TENSORS_FILE
from workbench.messages import conversation

T = TypeVar("T")
log = logging.getLogger("workbench.app")

# Grids over layers x positions grow with the prompt; past this the pages stop answering quickly.
MAX_PROMPT_TOKENS = 256
DEFAULT_PROMPT = "The Eiffel Tower is in the city of"
MEMO_ENTRIES = 16  # results kept per session, newest last
ARTIFACT_FILES = (MANIFEST_FILE, TENSORS_FILE)
MAX_ARTIFACT_BYTES = 1 << 30  # refuse uploaded zips that unpack to more than this


def cli_options(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The ``--model`` (None: the embedded model), ``--quantize``, ``--device``, ``--devices`` (comma-separated),
    ``--dtype`` and ``--numerics`` given after ``--`` on the ``streamlit run`` line."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--devices", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--numerics", default="exact", choices=workbench.kernels.NUMERICS)
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args


@st.cache_resource(show_spinner=False)
def _load(path: str | None, quantize: str | None, device: str | None, devices: str | None,
          dtype: str | None) -> workbench.Model:
    return workbench.load(path, quantize=quantize, device=device, devices=devices.split(",") if devices else None,
                          dtype=dtype)


def model() -> workbench.Model:
    """The model of this server, loaded once and shared by every session and rerun."""
    options = cli_options()
    with st.spinner(f"Loading {options.model or 'the embedded SmolLM2-135M'}…"):
        try:
            return _load(options.model, options.quantize, options.device, options.devices, options.dtype)
        except WorkbenchError as err:
            st.error(f"Could not load the model: {err}")
            st.stop()


@contextmanager
def guard() -> Iterator[None]:
    """Show errors inline instead of a traceback; the rest of the page keeps working."""
    try:
        yield
    except WorkbenchError as err:
        st.error(str(err), icon=":material/error:")
    except Exception as err:  # a bug, not bad input: keep the app alive and log the traceback server-side
        log.exception("unexpected error in the dashboard")
        st.error(f"Unexpected {type(err).__name__}: {err}", icon=":material/bug_report:")


def attempt(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """``fn(*args, **kwargs)``, or None after showing its error inline."""
    with guard():
        return fn(*args, **kwargs)
    return None


@contextmanager
def upload_folder(label: str, file: str | None = None) -> Iterator[Path]:
    """A private temporary folder for uploads that APIs read by path. An error naming the folder, or ``file`` in it,
    names the upload (``label``) instead: the folder is gone by the time the message is read."""
    with tempfile.TemporaryDirectory(prefix="workbench-upload-") as folder:
        try:
            yield Path(folder)
        except WorkbenchError as err:
            message = str(err).replace(str(Path(folder) / file), label) if file else str(err)
            raise type(err)(message.replace(f"{folder}/", f"{label}: ").replace(folder, label)) from None


@contextmanager
def upload_on_disk(upload: Any, name: str) -> Iterator[Path]:
    """An uploaded file written to a private temporary folder as ``name`` (for APIs that read paths)."""
    with upload_folder(upload.name, name) as folder:
        path = folder / name
        path.write_bytes(upload.getvalue())
        yield path


def remember(key: tuple, compute: Callable[[], T], message: str | None = None) -> T:
    """A result kept in this session (so reruns answer at once), computed (under a spinner) when new."""
    memo: OrderedDict = st.session_state.setdefault("_memo", OrderedDict())
    key = _hashable(key)
    if key in memo:
        memo.move_to_end(key)
        return memo[key]
    if message is None:
        result = compute()
    else:
        with st.spinner(message):
            result = compute()
    memo[key] = result
    while len(memo) > MEMO_ENTRIES:
        memo.popitem(last=False)
    return result


def _hashable(value: Any) -> Any:
    """A memo key with its lists and dicts (a conversation prompt's) as tuples."""
    if isinstance(value, dict):
        return tuple((k, _hashable(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def with_progress(label: str, work: Callable[[Callable[[int, int], None]], T]) -> T:
    """``work(report)`` with a progress bar that ``report(done, total)`` moves; the bar goes when done."""
    bar = st.progress(0.0, text=label)
    try:
        return work(lambda done, total: bar.progress(min(done / max(total, 1), 1.0), text=f"{label} ({done}/{total})"))
    finally:
        bar.empty()


# ------------------------------------------------------------------------------------- artifacts


def artifact_zip(trace: workbench.Trace) -> bytes:
    """``Trace.save`` output (manifest + tensors) as one zip, for the download button."""
    with tempfile.TemporaryDirectory(prefix="workbench-trace-") as folder:
        trace.save(folder)
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
            for name in ARTIFACT_FILES:
                archive.write(Path(folder) / name, name)
    return buffer.getvalue()


def trace_from_upload(uploads: list) -> workbench.Trace:
    """A trace from an uploaded zip or from its two files; ``load_trace`` verifies every hash."""
    files: dict[str, bytes] = {}
    for upload in uploads:
        if upload.name.endswith(".zip"):
            try:
                with zipfile.ZipFile(upload) as archive:
                    for info in archive.infolist():  # read only the two known names, never extract paths
                        name = Path(info.filename).name
                        if name in ARTIFACT_FILES:
                            if info.file_size > MAX_ARTIFACT_BYTES:
                                raise WorkbenchError(f"{upload.name}: {name} unpacks to {info.file_size} bytes")
                            files[name] = archive.read(info)
            except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, NotImplementedError) as err:
                raise WorkbenchError(f"{upload.name} is not a readable zip ({err})") from None
        elif upload.name in ARTIFACT_FILES:
            files[upload.name] = upload.getvalue()
    missing = [name for name in ARTIFACT_FILES if name not in files]
    if missing:
        raise WorkbenchError(f"the upload lacks {', '.join(missing)}: upload the zip the Save button makes, "
                             f"or its {' and '.join(ARTIFACT_FILES)}")
    with upload_folder(uploads[0].name if len(uploads) == 1 else "the upload") as folder:
        for name, data in files.items():
            (folder / name).write_bytes(data)
        return workbench.load_trace(folder)


# ----------------------------------------------------------------------------------------- prompt

# Keys of widgets whose values a script may not set (buttons, downloads, uploads): Streamlit refuses it.
UNSETTABLE_KEYS = frozenset({"ar_keep", "ar_replay", "ar_download", "ar_upload", "iv_control_file"})
_PLAIN = (str, int, float, bool, type(None))


def keep_widget_values() -> None:
    """Keep every page's settings while another page shows. Streamlit forgets a widget's value in a run that does not
    draw it (another page, the system prompt while the chat template is off) unless the script set it in that run:
    each plain value is set here to itself, first thing in every run."""
    for key in list(st.session_state):
        value = st.session_state[key]
        plain = isinstance(value, _PLAIN) or (isinstance(value, (list, tuple))
                                              and all(isinstance(v, _PLAIN) for v in value))
        if plain and key not in UNSETTABLE_KEYS:
            st.session_state[key] = value


def prompt_inputs() -> None:
    """The session's prompt, edited in the sidebar and read by every page."""
    st.session_state.setdefault("prompt", DEFAULT_PROMPT)
    st.sidebar.text_area("Prompt", key="prompt", height=110,
                         help="Every page analyses this prompt. Ctrl+Enter applies it.")
    if st.sidebar.toggle("Chat template", key="chat",
                         help="Wrap the prompt as a user message in the model's chat template."):
        st.sidebar.text_area("System prompt", key="system", height=68,
                             help="A system message before the prompt (left empty: none).")


def prompt() -> tuple[str | list[dict[str, str]], bool]:
    """The sidebar's prompt and chat flag: with the chat template and a system prompt, the conversation of the two."""
    text, chat = st.session_state.get("prompt", DEFAULT_PROMPT), bool(st.session_state.get("chat", False))
    system = st.session_state.get("system", "")
    return (conversation(text, system) if chat and system.strip() else text), chat


def check_prompt(m: workbench.Model, text: str | list[dict[str, str]], chat: bool = False) -> list[int]:
    """The prompt's token ids, or a WorkbenchError naming what is wrong with it."""
    ids = m.to_ids(text, chat=chat)
    if len(ids) > MAX_PROMPT_TOKENS:
        raise WorkbenchError(f"the prompt has {len(ids)} tokens; the dashboard analyses at most "
                             f"{MAX_PROMPT_TOKENS} (use the Python API for longer ones)")
    return ids


def session_prompt_ids(m: workbench.Model) -> list[int] | None:
    """The sidebar prompt's ids, or None after an inline error (empty, over-long...)."""
    text, chat = prompt()
    return attempt(check_prompt, m, text, chat)


def forget_on_new_prompt(page: str, ids: Sequence[int], keys: Sequence[str]) -> None:
    """Drop a page's prompt-specific state (widget values, results) when the prompt changes."""
    if st.session_state.get(f"_{page}_ids") != list(ids):
        st.session_state[f"_{page}_ids"] = list(ids)
        for key in keys:
            st.session_state.pop(key, None)


def session_trace(m: workbench.Model, record: Sequence[str] = ()) -> "workbench.hooks.Trace | None":
    """``model.run`` of the sidebar prompt recording ``record``, kept for the session; None after an error."""
    text, chat = prompt()
    if attempt(check_prompt, m, text, chat) is None:
        return None
    return attempt(remember, ("run", text, chat, tuple(record)),
                   lambda: m.run(text, chat=chat, record=list(record) or None), "Running the model…")


def generate(m: workbench.Model, prompt: str | Sequence[int] | list[dict[str, str]], max_new_tokens: int, label: str,
             **kwargs: Any) -> str:
    """``model.stream`` to text, with a progress bar while tokens arrive."""
    def work(report: Callable[[int, int], None]) -> str:
        pieces = []
        for n, (_, text) in enumerate(m.stream(prompt, max_new_tokens, **kwargs), 1):
            pieces.append(text)
            report(n, max_new_tokens)
        return "".join(pieces)

    return with_progress(label, work)


# -------------------------------------------------------------------------------------- display


def visible(token: str) -> str:
    """Token text with its whitespace made visible."""
    return token.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥") or "∅"


def axis_labels(tokens: Sequence[str]) -> list[str]:
    """Unique axis labels (``3 ␣Paris``) for tokens that may repeat."""
    return [f"{i} {visible(t)}" for i, t in enumerate(tokens)]


_CSS = """<style>
.block-container { padding-top: 2.2rem; }
.wb-chips { display: flex; flex-wrap: wrap; gap: 4px; margin: 2px 0 10px 0; }
.wb-chip { font-family: ui-monospace, monospace; font-size: 0.85rem; padding: 1px 7px; border-radius: 6px;
           background: rgba(99, 110, 250, 0.12); border: 1px solid rgba(99, 110, 250, 0.35); white-space: pre; }
.wb-chip sub { color: #888; font-size: 0.65rem; margin-left: 3px; }
.wb-chip.hi { background: rgba(239, 85, 59, 0.18); border-color: rgba(239, 85, 59, 0.6); }
</style>"""


def token_chips(tokens: Sequence[str], ids: Sequence[int] | None = None, highlight: Sequence[int] = ()) -> None:
    """Tokens as chips with their position; hover shows the id."""
    chips = []
    for i, token in enumerate(tokens):
        title = f"position {i}" + (f" · id {ids[i]}" if ids is not None else "")
        cls = "wb-chip hi" if i in highlight else "wb-chip"
        chips.append(f'<span class="{cls}" title="{title}">{html.escape(visible(token))}<sub>{i}</sub></span>')
    st.markdown(f'<div class="wb-chips">{"".join(chips)}</div>', unsafe_allow_html=True)


def page_style() -> None:
    """The dashboard's CSS: tighter top margin, token chips."""
    st.markdown(_CSS, unsafe_allow_html=True)


def heatmap(z, x_labels: Sequence[str], y_labels: Sequence[str], *, title: str = "", colorbar: str = "",
            value_format: str = ".3f", colorscale: str = "Viridis", zmid: float | None = None,
            zmin: float | None = None, zmax: float | None = None,
            height: int | None = None, x_title: str = "", y_title: str = "") -> go.Figure:
    """A labelled heatmap; rows are ``y_labels`` top to bottom as given."""
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(len(x_labels))), y=list(range(len(y_labels))), colorscale=colorscale,
        zmid=zmid, zmin=zmin, zmax=zmax,
        colorbar=dict(title=colorbar, thickness=12),
        hovertemplate=f"%{{customdata}}<br>{colorbar or 'value'} %{{z:{value_format}}}<extra></extra>",
        customdata=[[f"{y} · {x}" for x in x_labels] for y in y_labels],
    ))
    fig.update_xaxes(tickvals=list(range(len(x_labels))), ticktext=list(x_labels), title=x_title, tickangle=-45)
    fig.update_yaxes(tickvals=list(range(len(y_labels))), ticktext=list(y_labels), title=y_title, autorange="reversed")
    return style(fig, title, height or max(260, 22 * len(y_labels) + 120))


def style(fig: go.Figure, title: str | None = None, height: int = 360) -> go.Figure:
    """The dashboard's common figure look: compact margins, white background (title kept when None)."""
    title = fig.layout.title.text or "" if title is None else title
    fig.update_layout(title=dict(text=title, x=0, font=dict(size=14)), height=height, template="plotly_white",
                      margin=dict(l=10, r=10, t=40 if title else 10, b=10))
    return fig


def top_k_bars(pairs: Sequence[tuple[str, float]], title: str, color: str = "#636EFA") -> go.Figure:
    """Horizontal bars of (token, probability), most likely on top."""
    fig = go.Figure(go.Bar(x=[p for _, p in pairs], y=[visible(t) for t, _ in pairs], orientation="h",
                           marker_color=color, text=[f"{p:.3f}" for _, p in pairs], textposition="auto",
                           hovertemplate="%{y}: %{x:.4f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(range=[0, 1], title="probability")
    return style(fig, title, 40 + 26 * len(pairs))


def residual_change(base: "workbench.hooks.Trace", other: "workbench.hooks.Trace", n_layers: int,
                    title: str) -> go.Figure:
    """Heatmap of ‖Δresid_post‖ / ‖resid_post‖ per layer and position between two traces of one prompt."""
    names = [f"blocks.{i}.hook_resid_post" for i in range(n_layers)]
    missing = [n for n in names if n not in base.activations or n not in other.activations]
    if missing:
        raise WorkbenchError(f"both traces must record blocks.*.hook_resid_post (missing {missing[0]})")
    if base.ids != other.ids:
        raise WorkbenchError("the traces are of different prompts; the residual change needs the same tokens")
    change = results.relative_change(base, other, names)
    return heatmap(change.tolist(), axis_labels(base.tokens), [f"L{i}" for i in range(n_layers)], title=title,
                   colorbar="relative change", colorscale="Reds", zmin=0, zmax=max(float(change.max()), 1e-6),
                   height=520)


def next_token_comparison(m: workbench.Model, base_logits, other_logits) -> results.NextTokenComparison:
    """What ``compare_next_token`` shows: ``workbench.results.compare_next_token`` with the top 8 of each."""
    return results.compare_next_token(base_logits, other_logits, m, k=8)


def compare_next_token(m: workbench.Model, base_logits, other_logits, names: tuple[str, str], key: str) -> None:
    """KL, the baseline favourite's probability shift and both top-k charts, side by side."""
    comparison = next_token_comparison(m, base_logits, other_logits)
    favourite, top = comparison.baseline_top1, comparison.edited.top[0]
    first, second, third = st.columns(3)
    first.metric(f"KL({names[0]} ‖ {names[1]})", f"{comparison.kl:.3f} nats")
    second.metric(f"p({visible(favourite.token)})", f"{favourite.edited_prob:.3f}", f"{favourite.prob_delta:+.3f}")
    third.metric(f"{names[1]} top: {visible(top.token)}", f"{top.prob:.3f}")
    left, right = st.columns(2)
    left.plotly_chart(top_k_bars(token_probs(comparison.baseline), names[0]), key=f"{key}_a")
    right.plotly_chart(top_k_bars(token_probs(comparison.edited), names[1], color="#EF553B"), key=f"{key}_b")


def token_probs(distribution: results.Distribution) -> list[tuple[str, float]]:
    """(token text, probability) of a distribution's top tokens, for ``top_k_bars``."""
    return [(t.token, t.prob) for t in distribution.top]


def parse_positions(text: str, field: str = "positions") -> list[int] | str | None:
    """Positions typed as ``all``, ``generated``, or integers such as ``-1`` or ``0, 3, 4``. ``field``: the box's name
    for the error (other index lists reuse the parser: neurons take ``all`` or integers, not ``generated``)."""
    text = text.strip().lower()
    keywords = "'all', 'generated'" if field == "positions" else "'all'"
    if text in ("", "all"):
        return None
    if text == "generated" and field == "positions":
        return "generated"
    try:
        return [int(p) for p in text.replace(",", " ").split()]
    except ValueError:
        raise WorkbenchError(f"{field} must be {keywords} or integers like '-1' or '0, 3', got {shorten(text)}") from None
