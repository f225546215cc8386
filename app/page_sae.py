"""SAE features: load a sparse autoencoder or transcoder, pick a feature (by index, or among the prompt's most active
ones), see where it fires over a prompt set, what its decoder direction promotes, and steer generation with it."""
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st

from workbench import hooks, probes
from workbench.app import common
from workbench.errors import WorkbenchError
from workbench.probes.sae import CFG_FILENAME, WEIGHTS_FILENAME

st.header("SAE features")
model = common.model()

load_col, _ = st.columns([3, 1])
with load_col:
    path = st.text_input("SAE", key="sae_path", placeholder="folder with cfg.json + sae_weights.safetensors, or a "
                                                              "Gemma Scope params.npz",
                         help="SAELens' format; loaded and checked against this model (docs/saes.md).")
path = path.strip()
if not path:
    st.info("Give the path of an SAE trained on this model (``python bench/train_sae.py --out FOLDER`` makes one).")
    st.stop()


def logit_bars(pairs, title: str, color: str) -> go.Figure:
    fig = go.Figure(go.Bar(x=[v for _, v in pairs], y=[common.visible(t) for t, _ in pairs], orientation="h",
                           marker_color=color, hovertemplate="%{y}: %{x:.4f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(title="logit per unit of activation")
    return common.style(fig, title, 40 + 26 * len(pairs))


def load(where: str):
    file = Path(where)
    # load_sae reads any other file as its folder's SAE and then blames the folder
    if file.is_file() and file.suffix != ".npz" and file.name not in (CFG_FILENAME, WEIGHTS_FILENAME):
        raise WorkbenchError(f"{file} is a file, not an SAE folder ({CFG_FILENAME} + {WEIGHTS_FILENAME}) or a Gemma "
                             "Scope params.npz")
    sae = probes.load_sae(where)
    hooks.check_saes([sae], model.config)
    return sae


sae = common.attempt(common.remember, ("sae", path), lambda: load(path), "Loading the SAE…")
if sae is None:
    st.stop()
st.caption(f"{sae.architecture} · reads {sae.hook}" + (f" · writes {sae.hook_out}" if sae.is_transcoder else "")
           + f" · {sae.d_sae:,} features" + (f" · k {sae.k}" if sae.k else ""))

ids = common.session_prompt_ids(model)
if ids is None:
    st.stop()
rows = common.attempt(common.remember, ("sae_top", path, tuple(ids)), lambda: probes.top_features(model, sae, ids, 3),
                      "Encoding the prompt…")
if rows is None:
    st.stop()
prompt_features = list(dict.fromkeys(f for row in rows for f, _ in row["features"]))

pick, corpus_col = st.columns([1, 1], gap="large")
with pick:
    source = st.radio("Feature", ["Active on the prompt", "By index"], horizontal=True, key="sae_pick")
    if source == "By index" or not prompt_features:
        feature = int(st.number_input("Index", 0, sae.d_sae - 1, 0, key="sae_index"))
    else:
        strongest = {f: max(a for r in rows for g, a in r["features"] if g == f) for f in prompt_features}
        feature = st.selectbox("Most active on the prompt", prompt_features, key="sae_active",
                               format_func=lambda f: f"{f} (max {strongest[f]:.2f})")
with corpus_col:
    datasets = list(probes.list_datasets())
    name = st.selectbox("Prompt set for contexts and density", datasets, key="sae_dataset")
    limit = st.slider("Prompts", 4, 200, 32, 4, key="sae_prompts")

per_token = [next((a for f, a in row["features"] if f == feature), 0.0) for row in rows]
st.caption("Its activation on each token of the prompt (3 most active features a token are kept):")
common.token_chips(model.token_texts(ids), ids, highlight=[p for p, a in enumerate(per_token) if a > 0])

prompts = probes.load_dataset(name).prompts[:limit]
stats = common.attempt(common.remember, ("sae_stats", path, name, limit),
                       lambda: common.with_progress("Running the prompt set", lambda report: probes.feature_stats(
                           model, sae, prompts, n=8, progress=report)))
if stats is None:
    st.stop()
a, b, c = st.columns(3)
a.metric("Density", f"{float(stats.density[feature]):.4%}", help=f"Share of the set's {stats.tokens:,} tokens it "
                                                                 "fires on")
b.metric("Max activation", f"{float(stats.max_act[feature]):.3f}")
c.metric("Dead features in the set", f"{float((stats.density == 0).float().mean()):.1%}")

contexts, promoted = st.columns([3, 2], gap="large")
with contexts:
    st.subheader("Top contexts")
    examples = stats.examples(model, feature, context=8)
    if not examples:
        st.write("It fires on no token of this set.")
    for example in examples:
        st.caption(f"{example['activation']:.3f} · prompt {example['prompt']}, position {example['position']}")
        common.token_chips(example["tokens"], highlight=[example["at"]])
with promoted:
    if sae.d_out == model.config.d_model:
        tokens = probes.promoted_tokens(model, sae, feature, 10)
        st.plotly_chart(logit_bars(tokens["promoted"], "Promoted tokens (decoder direction → logits)", "#636EFA"),
                        key="sae_promoted")
        st.plotly_chart(logit_bars(tokens["suppressed"], "Suppressed tokens", "#EF553B"), key="sae_suppressed")

st.subheader("Steer with it")
steer_a, steer_b, steer_c = st.columns([1, 1, 1])
scale = steer_a.slider("Added to its activation", -50.0, 50.0, 10.0, 1.0, key="sae_scale")
new_tokens = steer_b.slider("New tokens", 4, 64, 16, 4, key="sae_new")
if steer_c.button("Generate", type="primary", use_container_width=True):
    with common.guard():
        text, chat = common.prompt()
        steered = common.generate(model, text, new_tokens, "Steered…", chat=chat,
                                  interventions=[probes.FeatureSteer(sae, feature, scale)])
        plain = common.generate(model, text, new_tokens, "Plain…", chat=chat)
        st.session_state.sae_generated = plain, steered
if "sae_generated" in st.session_state:
    plain, steered = st.session_state.sae_generated
    left, right = st.columns(2)
    # a keyed widget shows its state, not a new value: the state is the latest generation
    st.session_state.sae_plain_text, st.session_state.sae_steered_text = plain, steered
    left.text_area("Plain", disabled=True, key="sae_plain_text")
    right.text_area("Steered", disabled=True, key="sae_steered_text")
