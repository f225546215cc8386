"""Probes: linear-probe accuracy across depth for a labelled dataset, and a PCA view at one depth."""
import plotly.express as px
import streamlit as st
from sklearn.decomposition import PCA

from workbench import probes
from workbench.app import common

st.header("Linear probes across depth")
model = common.model()
n_layers = model.config.n_layers
# Completion sets label each prompt by its own answer: too many classes for a probe.
labelled = [name for name in probes.list_datasets() if probes.load_dataset(name).kind != "completion"]

settings, chart = st.columns([1, 3], gap="large")
with settings:
    name = st.selectbox("Dataset", labelled, index=labelled.index("sentiment") if "sentiment" in labelled else 0,
                        key="pr_dataset", help="Pairs datasets probe positive vs negative.")
    st.caption(probes.list_datasets()[name])
    data = probes.load_dataset(name)
    per_record = 1 if data.kind == "classification" else 2  # a pair's two prompts are two examples
    most = min(80, per_record * len(data.records))
    if st.session_state.get("pr_examples", 0) > most:  # kept from a larger dataset
        st.session_state.pr_examples = most
    examples = st.slider("Examples", 10, most, min(16, most), 2, key="pr_examples",
                         help="A seeded, class-balanced sample (a pair gives two), run in batched forwards.")
    point = st.selectbox("Point", ["resid_post", "resid_mid", "resid_pre"], key="pr_point")
    pooling = st.radio("Pooling", ["last", "mean"], horizontal=True, key="pr_pooling",
                       help="The last token's activation, or the mean over the prompt's tokens.")
    step = st.number_input("Every n-th layer", 1, n_layers, 2, key="pr_step")
    run = st.button("Run depth sweep", type="primary", use_container_width=True)

if run:
    with common.guard():
        dataset = data.sample(max(1, examples // per_record))
        sweep = common.with_progress("Collecting activations", lambda report: probes.depth_sweep(
            model, dataset, layers=range(0, n_layers, step), point=point, pooling=pooling, progress=report))
        st.session_state.pr_sweep = dataset, sweep

with chart:
    if "pr_sweep" not in st.session_state:
        st.info("Pick a dataset and run the sweep: batched forwards record every layer at once.")
        st.stop()
    dataset, sweep = st.session_state.pr_sweep
    peak = sweep.peak_layer
    a, b, c = st.columns(3)
    a.metric("Peak accuracy", f"{sweep.accuracy[peak]:.2f}", help="Out-of-fold, 5-fold cross-validation")
    b.metric(f"Peak layer (depth {sweep.fraction(peak):.2f})", f"L{peak}")
    c.metric("Reaches 90% of peak", f"L{sweep.first_reaching(0.9)}")
    st.plotly_chart(common.style(sweep.figure(), height=380), key="pr_curve")

    layer = st.select_slider("PCA at layer", sweep.layers, value=peak, key="pr_layer",
                             format_func=lambda l: f"L{l} ({sweep.fraction(l):.2f})")
    features = sweep.features[layer].double().numpy()
    projected = PCA(n_components=2, random_state=0).fit(features)
    xy = projected.transform(features)
    share = projected.explained_variance_ratio_
    fig = px.scatter(x=xy[:, 0], y=xy[:, 1], color=sweep.labels, hover_name=dataset.prompts,
                     labels={"x": f"PC1 ({share[0]:.0%})", "y": f"PC2 ({share[1]:.0%})", "color": "label"})
    fig.update_traces(marker=dict(size=9, opacity=0.8, line=dict(width=0.5, color="white")))
    st.plotly_chart(common.style(fig, f"{sweep.dataset} at layer {layer} ({sweep.point}, {sweep.pooling} token): "
                                      f"first two principal components", 440), key="pr_pca")
