"""Run & lens: the prompt's tokens, the next-token distribution, the logit lens, token tracking, residual norms."""
import plotly.graph_objects as go
import streamlit as st

from workbench import probes
from workbench.app import common

st.header("Run & logit lens")
model = common.model()
text, chat = common.prompt()
ids = common.session_prompt_ids(model)
if ids is None:
    st.stop()
lens = common.attempt(common.remember, ("lens", text, chat),
                      lambda: probes.logit_lens(model, text, chat=chat), "Running the logit lens…")
if lens is None:
    st.stop()
common.token_chips(lens.tokens, lens.ids, highlight=[len(lens.ids) - 1])
common.forget_on_new_prompt("lens", lens.ids, ["track_position", "track_tokens"])

final_ids = lens.top_tokens(layer=-1, position=-1)
final_probs = lens.probs[-1, -1].tolist()
heat, side = st.columns([3, 1], gap="medium")
with side:
    st.plotly_chart(common.top_k_bars(list(zip(model.token_texts(final_ids), final_probs)), "Next token"),
                    key="lens_next_token")
with heat:
    st.plotly_chart(common.style(lens.figure(), height=620), key="lens_heatmap")

st.subheader("Track tokens across depth", divider="gray")
position = st.select_slider("At position", range(len(lens.ids)), value=len(lens.ids) - 1,
                            format_func=lambda p: common.axis_labels(lens.tokens)[p], key="track_position")
# Candidates: whatever the lens ranks first at this position in some layer, best final ones first.
candidates = list(dict.fromkeys(
    final_ids[:5] + [lens.top_tokens(layer, position)[0] for layer in range(model.config.n_layers)]))
pick, extra = st.columns([2, 1])
chosen = pick.multiselect("Tokens", candidates, default=candidates[:2], key="track_tokens",
                          format_func=lambda i: common.visible(model.tokenizer.token_text(i)))
typed = extra.text_input("Add a token by its text", key="track_text", placeholder="e.g. ' London'",
                         help="One token exactly, leading space included.")
tokens = chosen + ([typed] if typed else [])
if tokens:
    track = common.attempt(common.remember, ("race", text, chat, tuple(tokens)), lambda: lens.track_race(tokens))
    if track is not None:
        st.plotly_chart(common.style(track.figure(position), height=380), key="track_figure")

st.subheader("Residual stream norm", divider="gray")
trace = common.session_trace(model, ["blocks.*.hook_resid_post"])
if trace is not None:
    n_layers = model.config.n_layers
    norms = [trace.activations[f"blocks.{i}.hook_resid_post"].norm(dim=-1) for i in range(n_layers)]
    fig = go.Figure([go.Scatter(x=list(range(n_layers)), y=[float(n[p]) for n in norms], mode="lines",
                                name=label, hovertemplate="layer %{x}: %{y:.1f}<extra>" + label + "</extra>")
                     for p, label in enumerate(common.axis_labels(trace.tokens))])
    log_scale = st.toggle("Log scale", value=True, key="norm_log")
    fig.update_yaxes(type="log" if log_scale else "linear", dtick=1 if log_scale else None, title="‖resid_post‖")
    fig.update_xaxes(title="layer")
    st.plotly_chart(common.style(fig, height=380), key="resid_norms")

st.subheader("Direct logit attribution", divider="gray")
if st.toggle("Split the next-token logit over embedding, heads and MLPs", key="dla_on"):
    names = model.token_texts(final_ids[:10])
    target_pick, baseline_pick = st.columns(2)
    target = target_pick.selectbox("Target", range(10), format_func=lambda i: common.visible(names[i]),
                                   key="dla_target")
    baseline = baseline_pick.selectbox("Minus", [None, *range(10)], index=2, key="dla_baseline",
                                       format_func=lambda i: "nothing" if i is None else common.visible(names[i]))
    key = ("dla", text, chat, final_ids[target], None if baseline is None else final_ids[baseline])
    attribution = common.attempt(common.remember, key, lambda: probes.direct_logit_attribution(
        model, text, final_ids[target], None if baseline is None else final_ids[baseline], chat=chat),
        "Attributing…")
    if attribution is not None:
        bars, grid = st.columns([3, 2])
        bars.plotly_chart(common.style(attribution.figure(top=20), height=420), key="dla_bars")
        heads = attribution.heads()
        grid.plotly_chart(common.heatmap(heads.numpy(), [f"H{h}" for h in range(heads.shape[1])],
                                         [f"L{i}" for i in range(heads.shape[0])], title="Heads", colorbar="logit",
                                         colorscale="RdBu", zmid=0, height=420), key="dla_heads")
