"""Interventions: build steer / ablate / patch edits with widgets; compare baseline and edited runs."""
import hashlib
import json

import streamlit as st

from workbench import hooks, probes
from workbench.app import common
from workbench.errors import WorkbenchError

# Where to intervene: a per-layer hook point, and which extra selector it takes.
SITES = {
    "Residual stream (hook_resid_post)": ("hook_resid_post", None),
    "Residual stream (hook_resid_pre)": ("hook_resid_pre", None),
    "Attention output (hook_attn_out)": ("hook_attn_out", None),
    "MLP output (hook_mlp_out)": ("hook_mlp_out", None),
    "Attention heads (attn.hook_z)": ("attn.hook_z", "heads"),
    "MLP neurons (mlp.hook_post)": ("mlp.hook_post", "neurons"),
}

KINDS = ["Steer", "Zero-ablate", "Mean-ablate", "Scale", "Patch"]
SOURCES = ["Trace difference", "Dataset steering vector", "Control vector file"]
RECORD = ["blocks.*.hook_resid_post"]

st.header("Interventions")
model = common.model()
text, chat = common.prompt()
baseline = common.session_trace(model, RECORD)
if baseline is None:
    st.stop()
n_layers = model.config.n_layers
# the sites this model has (an MoE block has no mlp.hook_post)
SITES = {label: site for label, site in SITES.items() if f"blocks.0.{site[0]}" in model.hook_points()}
STEERABLE = [label for label, (_, selector) in SITES.items() if selector is None]
steering_sets = [name for name, kind in
                 ((n, probes.load_dataset(n).kind) for n in probes.list_datasets()) if kind != "completion"]


def steering(source: str, point: str, layers: list[int], settings: dict) -> "probes.SteeringVector":
    """The steering vector of the chosen source (kept for the session: datasets take a while)."""
    if source == "Control vector file":
        with common.upload_on_disk(settings["upload"], "control_vector.gguf") as path:
            return probes.SteeringVector.from_control_vector(path, model)
    if source == "Trace difference":
        pair = (settings["positive"], settings["negative"])
        for label, text in zip(("Towards", "Away from"), pair):
            if not text.strip():  # named by its box here; the probes would name a dataset line
                raise WorkbenchError(f"{label} is empty: give a prompt to steer {label.lower()}")
        return common.remember(("steer", pair, point, tuple(layers)), lambda: probes.steering_vector(
            model, ([pair[0]], [pair[1]]), layers, point), "Recording both prompts…")
    dataset = probes.load_dataset(settings["dataset"]).sample(settings["examples"])
    key = ("steer", settings["dataset"], settings["examples"], point, tuple(layers))
    return common.remember(key, lambda: common.with_progress(
        "Collecting dataset activations", lambda report: probes.steering_vector(
            model, dataset, layers, point, progress=report)))


def build(kind: str, point: str, layers: list[int], positions, heads, neurons, settings: dict) -> list:
    """The interventions the widgets describe."""
    if kind == "Steer":
        return steering(settings["source"], point, layers, settings).interventions(settings["scale"], positions)
    built = []
    for layer in layers:
        hook, where = f"blocks.{layer}.{point}", dict(positions=positions, heads=heads, neurons=neurons)
        if kind == "Zero-ablate":
            built.append(hooks.ZeroAblate(hook, **where))
        elif kind == "Mean-ablate":  # the mean over this prompt's own positions
            reference = common.session_trace(model, [hook])
            if reference is None:
                return []
            built.append(hooks.MeanAblate.from_traces(hook, [reference], **where))
        elif kind == "Scale":
            built.append(hooks.Scale(hook, factor=settings["factor"], **where))
        else:
            built.append(hooks.Patch(hook, donor=settings["donor"], **where))
    return built


builder, results = st.columns([2, 3], gap="large")
with builder:
    st.subheader("Edit", divider="gray")
    kind = st.radio("Intervention", KINDS, horizontal=True, key="iv_kind")
    settings: dict = {}
    if kind == "Steer":
        settings["source"] = st.radio("Vector", SOURCES, key="iv_source", horizontal=True)
    control_file = kind == "Steer" and settings["source"] == "Control vector file"
    if control_file:  # the file fixes the layers and the point (llama.cpp steers block outputs)
        point, selector = "hook_resid_post", None
        settings["upload"] = st.file_uploader("Control vector (.gguf)", type=["gguf"], key="iv_control_file")
    else:
        site = st.selectbox("Site", STEERABLE if kind == "Steer" else list(SITES), key="iv_site")
        point, selector = SITES[site]
        first, last = st.slider("Layers", 0, n_layers - 1, (n_layers // 3, n_layers // 3), key="iv_layers")
    layers = [] if control_file else list(range(first, last + 1))
    positions_text = st.text_input("Positions", "all", key="iv_positions",
                                   help="'all', 'generated', or token positions such as '-1' or '0, 3'.")
    heads = None
    if selector == "heads":
        heads = st.multiselect("Heads (none: all)", range(model.config.n_heads), key="iv_heads") or None
    neurons_text = st.text_input("Neurons", "0", key="iv_neurons", help="Indices such as '12, 40'.") \
        if selector == "neurons" else ""
    if kind == "Steer":
        if settings["source"] == "Trace difference":
            settings["positive"] = st.text_input("Towards", "I love this, it is wonderful", key="iv_positive")
            settings["negative"] = st.text_input("Away from", "I hate this, it is awful", key="iv_negative")
        elif settings["source"] == "Dataset steering vector":
            settings["dataset"] = st.selectbox("Dataset", steering_sets, key="iv_dataset",
                                               format_func=lambda n: f"{n}: {probes.list_datasets()[n]}")
            settings["examples"] = st.slider("Examples", 4, 80, 12, key="iv_examples",
                                             help="A seeded sample of the dataset (one forward per prompt).")
        settings["scale"] = st.number_input("Scale", -64.0, 64.0, 4.0, 0.5, key="iv_scale")
    elif kind == "Scale":
        settings["factor"] = st.number_input("Factor", -10.0, 10.0, 0.0, 0.1, key="iv_factor")
    elif kind == "Patch":
        settings["donor"] = st.text_input("Donor prompt", "The Colosseum is in the city of", key="iv_donor",
                                          help="Its activations replace the prompt's at the selected positions.")

    def interventions() -> list:
        positions = common.parse_positions(positions_text)
        neurons = common.parse_positions(neurons_text, "neurons") if selector == "neurons" else None
        return build(kind, point, layers, positions, heads, neurons, settings)

    if control_file and settings["upload"] is None:
        edits = None
        st.info("Upload a llama.cpp control vector (.gguf): it fixes the layers, steering each block's output.")
    else:
        edits = common.attempt(interventions)
    if edits:
        specs = [e.to_spec() for e in edits]
        with st.expander("Spec (JSON for model.run(..., interventions=...))"):
            st.code(json.dumps(specs), language="json", wrap_lines=True)

with results:
    st.subheader("Effect", divider="gray")
    if not edits:
        st.info("Set up a valid intervention on the left.")
        st.stop()
    key = (text, chat, hashlib.sha256(json.dumps(specs).encode()).hexdigest())
    edited = common.attempt(common.remember, ("edited", *key),
                            lambda: model.run(text, chat=chat, record=RECORD, interventions=edits),
                            "Running with the edit…")
    if edited is None:
        st.stop()
    st.session_state.edited_trace = edited  # the Artifacts page can save it
    common.compare_next_token(model, baseline.logits[-1], edited.logits[-1], ("Baseline", "Edited"), "iv_next")
    st.plotly_chart(common.residual_change(baseline, edited, n_layers,
                                           "Per-layer effect: ‖Δresid_post‖ / ‖resid_post‖"), key="iv_effect")

    st.subheader("Generations", divider="gray")
    n_new = st.slider("New tokens", 1, 64, 16, key="iv_new_tokens")
    if st.button("Generate both", type="primary"):
        with common.guard():
            base_text = common.remember(("generate", text, chat, n_new), lambda: common.generate(
                model, text, n_new, "Baseline", chat=chat), "Generating…")
            edit_text = common.generate(model, text, n_new, "Edited", chat=chat, interventions=edits)
            st.session_state.iv_generations = (key, base_text, edit_text)
    generations = st.session_state.get("iv_generations")
    if generations is not None and generations[0] == key:
        left, right = st.columns(2)
        left.markdown("**Baseline**")
        left.code(generations[1], language=None, wrap_lines=True)
        right.markdown("**Edited**")
        right.code(generations[2], language=None, wrap_lines=True)
