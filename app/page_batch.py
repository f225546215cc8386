"""Batch: many prompts in batched forwards: each one's next token, and the last token's residual norm across depth."""
import plotly.graph_objects as go
import streamlit as st

from workbench import probes, results
from workbench.app import common
from workbench.errors import WorkbenchError

MAX_PROMPTS = 256

st.header("Batch")
model = common.model()
n_layers = model.config.n_layers

settings, view = st.columns([1, 3], gap="large")
with settings:
    source = st.radio("Prompts", ["Typed", "Dataset"], horizontal=True, key="ba_source")
    if source == "Dataset":
        name = st.selectbox("Dataset", list(probes.list_datasets()), key="ba_dataset")
        prompts = probes.load_dataset(name).prompts
    else:
        typed = st.text_area("One prompt a line", "The capital of France is\nThe capital of Italy is\n"
                             "Water boils at a temperature of", key="ba_prompts", height=160)
        prompts = [line for line in typed.splitlines() if line.strip()]
    chat = st.toggle("Chat template", key="ba_chat")
    run = st.button("Run batch", type="primary", use_container_width=True)

if run:
    with common.guard():
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise WorkbenchError(f"give 1 to {MAX_PROMPTS} prompts, got {len(prompts)}")
        traces = common.with_progress("Running prompts", lambda report: model.run_batch(
            prompts, record=["blocks.*.hook_resid_post"], reduce="last", chat=chat, logits="last", progress=report))
        st.session_state.ba_result = prompts, traces

with view:
    if "ba_result" not in st.session_state:
        st.info("Type prompts or pick a dataset: they run together in batched forwards, each as it would alone.")
        st.stop()
    prompts, traces = st.session_state.ba_result
    rows = []
    for prompt, trace in zip(prompts, traces):
        distribution = results.next_token(trace.logits[-1], 3, model)
        top = distribution.top
        rows.append({"prompt": prompt, "tokens": len(trace.ids), "next token": common.visible(top[0].token),
                     "p": round(top[0].prob, 4), "runner-up": common.visible(top[1].token),
                     "entropy (nats)": round(distribution.entropy, 3)})
    st.dataframe(rows, use_container_width=True, hide_index=True)
    fig = go.Figure([go.Scatter(x=list(range(n_layers)),
                                y=[float(trace.activations[f"blocks.{i}.hook_resid_post"].norm())
                                   for i in range(n_layers)],
                                mode="lines", name=prompt[:40], hovertemplate="layer %{x}: %{y:.1f}")
                     for prompt, trace in zip(prompts, traces)])
    fig.update_xaxes(title="layer")
    fig.update_yaxes(title="‖resid_post‖ at the last token", type="log")
    st.plotly_chart(common.style(fig, "Residual norm across depth, last token of each prompt", height=420),
                    key="ba_norms")
