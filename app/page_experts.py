"""Experts: how a mixture-of-experts model routes the prompt's tokens, per layer, and what ablating an expert does."""
import hashlib
import json

import streamlit as st

from workbench.app import common
from workbench.moe import routing_matrix

st.header("Experts")
model = common.model()
moe = model.config.moe
if moe is None:
    st.info("This page needs a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, Gemma 4 26B-A4B): "
            "start the dashboard with `workbench app --model PATH`.")
    st.stop()
n_layers = model.config.n_layers
ROUTING = ["blocks.*.mlp.hook_expert_indices", "blocks.*.mlp.hook_expert_weights", "blocks.*.hook_resid_post"]
base = common.session_trace(model, ROUTING)
if base is None:
    st.stop()


def routing(trace, layer: int):
    a = trace.activations
    return routing_matrix(a[f"blocks.{layer}.mlp.hook_expert_indices"], a[f"blocks.{layer}.mlp.hook_expert_weights"],
                          moe.n_experts)


tokens = common.axis_labels(base.tokens)
experts = [f"E{e}" for e in range(moe.n_experts)]
st.caption(f"{moe.n_experts} experts, {moe.n_experts_used} per token, {moe.gating} routing"
           + (", weights normalized" if moe.normalize_weights else "")
           + (f", plus a shared expert of {moe.d_shared_expert}" if moe.d_shared_expert else "") + ".")
view, ablation = st.columns([3, 2], gap="large")
with view:
    st.subheader("Routing", divider="gray")
    layer = st.selectbox("Layer", range(n_layers), key="ex_layer")
    st.plotly_chart(common.heatmap(routing(base, layer).tolist(), experts, tokens, colorscale="Blues", zmin=0,
                                   title=f"Layer {layer}: each token's weight on each expert", colorbar="weight",
                                   x_title="expert", y_title="token"), key="ex_routing")
    load = [(routing(base, i) > 0).float().mean(0).tolist() for i in range(n_layers)]
    st.plotly_chart(common.heatmap(load, experts, [f"L{i}" for i in range(n_layers)], colorscale="Greens", zmin=0,
                                   zmax=1, title="Share of the prompt's tokens routed to each expert",
                                   colorbar="share", x_title="expert", y_title="layer"), key="ex_load")

with ablation:
    st.subheader("Ablate experts", divider="gray")
    chosen = st.multiselect("Experts", range(moe.n_experts), default=[0], format_func=lambda e: f"E{e}",
                            key="ex_experts")
    scope = st.selectbox("In", ["every layer", *[f"layer {i}" for i in range(n_layers)]], key="ex_scope")
    mode = st.radio("Mode", ["drop", "reroute"], horizontal=True, key="ex_mode",
                    help="drop: the token keeps its choice, the expert's weight becomes zero; "
                         "reroute: the router cannot pick the expert, the token takes its next best.")
    renormalize = st.checkbox("Renormalize the other experts' weights", key="ex_renormalize",
                              disabled=mode == "reroute")
    if not chosen:
        st.info("Choose experts to ablate.")
        st.stop()
    spec = {"type": "ablate_expert", "experts": list(chosen),
            "layer": None if scope == "every layer" else int(scope.split()[1]), "mode": mode,
            "renormalize": renormalize and mode == "drop"}
    with st.expander("Spec (JSON for model.run(..., interventions=...))"):
        st.code(json.dumps(spec), language="json", wrap_lines=True)
    text, chat = common.prompt()
    key = ("experts", text, chat, hashlib.sha256(json.dumps(spec).encode()).hexdigest())
    edited = common.attempt(common.remember, key,
                            lambda: model.run(text, chat=chat, record=ROUTING, interventions=[spec]),
                            "Running with the ablation…")
    if edited is None:
        st.stop()
    common.compare_next_token(model, base.logits[-1], edited.logits[-1], ("baseline", "ablated"), "ex_next")

st.plotly_chart(common.residual_change(base, edited, n_layers, "How much the ablation moves each block's output"),
                key="ex_residual")
if mode == "reroute":
    st.plotly_chart(common.heatmap(routing(edited, layer).tolist(), experts, tokens, colorscale="Blues", zmin=0,
                                   title=f"Layer {layer} rerouted", colorbar="weight", x_title="expert",
                                   y_title="token"), key="ex_rerouted")
