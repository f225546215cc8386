"""Artifacts: save a trace, load one, replay it for a verdict, compare two."""
import streamlit as st

import workbench
from workbench.app import common

VERDICT_STYLE = {"identical": st.success, "within tolerance": st.info, "different": st.error}

st.header("Trace artifacts")
model = common.model()
library: dict = st.session_state.setdefault("traces", {})  # name -> Trace, this session's shelf


def shelve(name: str, trace: workbench.Trace) -> str:
    """Keep a trace under a name of its own (another trace of the same prompt gets a number) and make it B of the
    comparison (set before that widget is drawn); a trace kept already stays where it is. Returns its name."""
    for kept, held in library.items():
        if held is trace:
            return kept
    unique, n = name, 1
    while unique in library:
        n += 1
        unique = f"{name} ({n})"
    library[unique] = trace
    st.session_state.ar_compare_b = unique
    return unique


save, load = st.columns(2, gap="large")
with save:
    st.subheader("Save", divider="gray")
    sources = {"The sidebar prompt": lambda: common.session_trace(model, ["blocks.*.hook_resid_post"])}
    if "edited_trace" in st.session_state:
        sources["The Interventions page's edited run"] = lambda: st.session_state.edited_trace
    source = st.radio("Trace", list(sources), key="ar_source")
    trace = sources[source]()
    if trace is not None:
        st.caption(f"{len(trace.ids)} tokens · {len(trace.activations)} recorded activations · "
                   f"{len(trace.interventions)} interventions")
        st.download_button("Download artifact (.zip)", lambda: common.artifact_zip(trace), "trace.zip",
                           "application/zip", type="primary", key="ar_download")
        label = f"{'edited' if trace.interventions else 'clean'}{' chat' if trace.chat else ''}: {trace.prompt!r}"[:80]
        st.button("Keep for replay and comparison", key="ar_keep", on_click=shelve, args=(label, trace))

with load:
    st.subheader("Load", divider="gray")
    uploads = st.file_uploader("Trace artifact (.zip, or manifest.json + tensors.safetensors)",
                               type=["zip", "json", "safetensors"], accept_multiple_files=True, key="ar_upload")
    if uploads:
        # the uploader hands the same files to every rerun: each upload is read and kept once
        uploaded: dict = st.session_state.setdefault("ar_uploaded", {})  # the files' ids -> the kept trace's name
        files = tuple(upload.file_id for upload in uploads)
        if files not in uploaded:
            loaded = common.attempt(common.trace_from_upload, uploads)
            if loaded is not None:
                uploaded[files] = shelve(f"uploaded: {uploads[0].name}", loaded)
        kept = library.get(uploaded.get(files))
        if kept is not None:
            st.success(f"Loaded {uploads[0].name}: {kept.prompt!r}, {len(kept.ids)} tokens, "
                       f"{len(kept.activations)} activations")

st.subheader("Replay", divider="gray")
if not library:
    st.info("Keep or upload a trace to replay and compare it.")
    st.stop()
pick, tolerance, button = st.columns([3, 1, 1], vertical_alignment="bottom")
name = pick.selectbox("Trace", list(library), key="ar_replay_pick")
force = tolerance.toggle("Force", key="ar_force", help="Replay even when the model's fingerprint differs.")
if button.button("Replay", type="primary", use_container_width=True, key="ar_replay"):
    with common.guard(), st.spinner("Replaying…"):
        st.session_state.ar_report = name, workbench.replay(library[name], model, force=force)
report = st.session_state.get("ar_report")
if report is not None and report[0] == name:
    VERDICT_STYLE[report[1].verdict](f"Verdict: **{report[1]}**")
    st.json(report[1].to_dict(), expanded=False)

st.subheader("Compare", divider="gray")
left, right = st.columns(2)
first = left.selectbox("A", list(library), key="ar_compare_a")
second = right.selectbox("B", list(library), key="ar_compare_b")
a, b = library[first], library[second]
left.code(f"{a.prompt!r}\n{len(a.interventions)} interventions", language=None, wrap_lines=True)
right.code(f"{b.prompt!r}\n{len(b.interventions)} interventions", language=None, wrap_lines=True)
if a.fingerprint.get("sha256") != b.fingerprint.get("sha256"):
    st.warning("The traces were recorded on different models.")
with common.guard():  # a trace from a batch run may keep no logits
    common.compare_next_token(model, a.logits_at(-1), b.logits_at(-1), ("A", "B"), "ar_next")
if a.ids == b.ids:
    figure = common.attempt(common.residual_change, a, b, model.config.n_layers,
                            "‖resid_post(B) − resid_post(A)‖ / ‖resid_post(A)‖")
    if figure is not None:
        st.plotly_chart(figure, key="ar_change")
else:
    st.caption("Different prompts: the per-layer comparison needs the same tokens.")
