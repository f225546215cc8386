"""Adapters: load LoRA adapters next to the model and compare each against the base on the same prompts."""
import plotly.graph_objects as go
import streamlit as st

from workbench import probes
from workbench.app import common
from workbench.errors import WorkbenchError

MAX_PROMPTS = 64

st.header("Adapters")
model = common.model()

settings, view = st.columns([1, 3], gap="large")
with settings:
    path = st.text_input("Adapter (GGUF file or PEFT folder)", key="ad_path",
                         help="a llama.cpp LoRA GGUF or a PEFT folder (adapter_config.json + adapter_model.safetensors)")
    name = st.text_input("Name", key="ad_name", help="default: the file's name")
    if st.button("Load adapter", use_container_width=True):
        with common.guard():
            if not path.strip():
                raise WorkbenchError("give the adapter's path")
            model.load_adapter(path.strip(), name=name.strip() or None)
    names = list(model.adapters)
    # no keys: a widget of new options (an adapter just loaded) starts on the first, not on a stale empty choice
    adapter = st.selectbox("Adapter to compare", names, disabled=not names)
    base = st.selectbox("Against", ["base"] + names)
    typed = st.text_area("One prompt a line", "The capital of France is\nWater boils at a temperature of",
                         key="ad_prompts", height=120)
    prompts = [line for line in typed.splitlines() if line.strip()]
    chat = st.toggle("Chat template", key="ad_chat")
    run = st.button("Compare", type="primary", use_container_width=True, disabled=not names)

if run:
    with common.guard():
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise WorkbenchError(f"give 1 to {MAX_PROMPTS} prompts, got {len(prompts)}")
        diff = common.with_progress("Running both sides", lambda report: probes.compare_models(
            model, prompts, adapter, None if base == "base" else base, chat=chat, progress=report))
        st.session_state.ad_result = prompts, diff

with view:
    if model.list_adapters():  # resident, then merged into the weights ("merged": what they were re-quantized to)
        st.dataframe([{k: v for k, v in a.items() if k != "sha256"} for a in model.list_adapters()],
                     use_container_width=True, hide_index=True)
    if "ad_result" not in st.session_state:
        st.info("Load a LoRA adapter, then compare it with the base: where the residual stream moves, which tokens "
                "the difference promotes, how far the next-token distributions are apart, and which components "
                "write the change.")
        st.stop()
    prompts, diff = st.session_state.ad_result
    st.metric(f"Mean KL({diff.a} ‖ {diff.b}) over all positions", f"{diff.mean_kl:.4f} nats")
    st.plotly_chart(common.style(diff.figure(), None, height=360), key="ad_resid")
    fig = go.Figure([go.Scatter(x=list(range(len(kl))), y=kl.tolist(), mode="lines+markers", name=prompt[:40])
                     for prompt, kl in zip(prompts, diff.kl)])
    fig.update_xaxes(title="position")
    fig.update_yaxes(title="KL (nats)")
    st.plotly_chart(common.style(fig, "KL per position"), key="ad_kl")
    st.subheader("Logit lens of the difference")
    st.dataframe([{"layer": layer, "promoted": ", ".join(common.visible(t) for t, _ in up[:5]),
                   "suppressed": ", ".join(common.visible(t) for t, _ in down[:5])}
                  for layer, (up, down) in enumerate(zip(diff.lens_promoted, diff.lens_suppressed))],
                  use_container_width=True, hide_index=True, key="ad_lens")
    st.plotly_chart(common.style(diff.attribution.figure(top=20), None, height=380), key="ad_dla")
