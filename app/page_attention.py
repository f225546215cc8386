"""Attention: one head's pattern with token labels, and a summary of every head."""
import streamlit as st
import torch

from workbench.app import common

st.header("Attention")
model = common.model()
trace = common.session_trace(model, ["blocks.*.attn.hook_pattern"])
if trace is None:
    st.stop()

config = model.config
labels = common.axis_labels(trace.tokens)
patterns = torch.stack([trace.activations[f"blocks.{i}.attn.hook_pattern"] for i in range(config.n_layers)])
# [layers, heads, query T, key S]
common.token_chips(trace.tokens, trace.ids)

left, right = st.columns([3, 2], gap="large")
with left:
    pick_layer, pick_head = st.columns(2)
    layer = pick_layer.slider("Layer", 0, config.n_layers - 1, config.n_layers // 2, key="attn_layer")
    head = pick_head.selectbox("Head", range(config.n_heads), key="attn_head")
    pattern = patterns[layer, head]
    st.plotly_chart(common.heatmap(pattern.numpy(), labels, labels, title=f"L{layer}H{head} attention pattern",
                                   colorbar="weight", colorscale="Blues", x_title="key", y_title="query",
                                   height=max(360, 24 * len(labels) + 140)), key="attn_pattern")

with right:
    st.subheader("Every head", divider="gray")
    if len(trace.ids) < 2:
        st.info("Head scores need a prompt of at least two tokens.")
        st.stop()
    later = patterns[:, :, 1:]  # queries after the first token, which can only attend to itself
    entropy = -(later * later.clamp_min(1e-12).log()).sum(-1).mean(-1)
    previous = patterns.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)  # weight on the token just before
    first = later[..., 0].mean(-1)  # weight on the first token (often an attention sink)
    heads = [f"H{h}" for h in range(config.n_heads)]
    layers = [f"L{i}" for i in range(config.n_layers)]
    scores = {"Previous-token score": (previous, "Reds"), "First-token score": (first, "Purples"),
              "Entropy (nats)": (entropy, "Greens")}
    tabs = st.tabs(list(scores))
    for tab, (name, (values, colors)) in zip(tabs, scores.items()):
        with tab:
            st.plotly_chart(common.heatmap(values.numpy(), heads, layers, colorbar=name.split(" (")[0],
                                           colorscale=colors, x_title="head", y_title="layer", height=620),
                            key=f"attn_{name}")
    best = int(previous.flatten().argmax())
    st.caption(f"Strongest previous-token head: **L{best // config.n_heads}H{best % config.n_heads}** "
               f"({float(previous.flatten()[best]):.2f} of its attention on the token before).")
