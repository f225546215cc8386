"""Patching: patch clean activations into the corrupt run cell by cell (or estimate every cell from one backward)
and map where the answer lives, for one pair of prompts or as the mean over a dataset of pairs."""
import streamlit as st

from workbench import hooks, probes
from workbench.app import common
from workbench.errors import WorkbenchError

SWEEPS = {"Layers × positions": ("layers", "positions"), "Layers × heads": ("layers", "heads"),
          "Layers × positions × heads": ("layers", "positions", "heads")}
POINTS = ["hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out"]
METHODS = ["Activation patching", "Attribution patching"]

st.header("Patching")
model = common.model()
n_layers = model.config.n_layers

prompts, options = st.columns([3, 2], gap="large")
with prompts:
    source = st.radio("Prompts", ["One pair", "A dataset"], horizontal=True, key="pt_source",
                      help="A dataset's grid is the mean of its pairs' grids, each pair with its own answers.")
    if source == "One pair":
        clean = st.text_input("Clean prompt", "The Eiffel Tower is in the city of", key="pt_clean")
        corrupt = st.text_input("Corrupted prompt", "The Colosseum is in the city of", key="pt_corrupt")
        ids = [common.attempt(common.check_prompt, model, p) for p in (clean, corrupt)]
    else:
        shipped = [n for n in probes.list_datasets() if probes.load_dataset(n).kind == "patching"]
        name = st.selectbox("Dataset", shipped, key="pt_dataset")
        st.caption(probes.list_datasets()[name])
        data = probes.load_dataset(name)
        count = st.number_input("Pairs (a seeded sample)", 1, len(data), min(8, len(data)), key="pt_pairs")
        pairs, pair_answers = data.sample(count).patching()
        clean, corrupt = pairs[0]
        ids = [common.attempt(common.check_prompt, model, p) for p in pairs[0]]
    for side, prompt_ids in zip(("clean", "corrupt"), ids):
        if prompt_ids is not None:
            st.caption(f"{side}{' (the first pair)' if source == 'A dataset' else ''}: {len(prompt_ids)} tokens")
            common.token_chips(model.token_texts(prompt_ids), prompt_ids)
    metric_name = st.radio("Metric", ["Logit difference", "Probability of the clean answer"], horizontal=True,
                           key="pt_metric")
    if source == "One pair":
        clean_answer, corrupt_answer = st.columns(2)
        answers = (clean_answer.text_input("Clean answer", "", key="pt_clean_answer", placeholder="its top token"),
                   corrupt_answer.text_input("Corrupt answer", "", key="pt_corrupt_answer",
                                             placeholder="its top token", disabled=metric_name != "Logit difference"))
    else:
        st.caption("Each pair's answers are the dataset's.")
with options:
    method = st.radio("Method", METHODS, horizontal=True, key="pt_method",
                      help="Attribution patching estimates every cell to first order from the gradient of the corrupt "
                           "run: fast, but it misses saturated effects; check the cells that matter by patching.")
    steps, verify = 1, 0
    if method == "Attribution patching":
        steps = st.number_input("Integrated-gradient steps", 1, 32, 1, key="pt_steps",
                                help="1: the gradient of the corrupt run. More: the mean gradient along the way from "
                                     "the corrupt inputs to the clean ones, closer to patching where effects "
                                     "saturate (one forward and backward each, batched).")
        verify = st.number_input("Verify the top cells by patching", 0, 64, 0, key="pt_verify",
                                 help="Patch this many cells of the largest estimated effect (a forward each, "
                                      "batched) and list them beside their estimates.")
    over = SWEEPS[st.radio("Sweep", list(SWEEPS), key="pt_over")]
    hook = "blocks.{layer}.attn.hook_z" if "heads" in over else \
        "blocks.{layer}." + st.selectbox("Hook point", POINTS, key="pt_point")
    first, last = st.slider("Layers", 0, n_layers - 1, (0, n_layers - 1), key="pt_layers")
    step = st.number_input("Every n-th layer", 1, n_layers, min(5, n_layers), key="pt_step")
    layers = list(range(first, last + 1, step))
    normalize = st.toggle("Normalize (0 = corrupt, 1 = clean)", value=True, key="pt_normalize")
    n_tokens = len(ids[0]) if ids[0] else 0
    cells = len(layers) * (n_tokens if "positions" in over else 1) * (model.config.n_heads if "heads" in over else 1)
    n_pairs = 1 if source == "One pair" else len(pairs)
    each = " for each pair" if n_pairs > 1 else ""
    st.caption(f"{cells * n_pairs} patched forwards (+{2 * n_pairs})" if method == "Activation patching" else
               f"{cells} cells from {steps + 1 if steps > 1 else 2} forwards and "
               f"{'a backward' if steps == 1 else f'{steps} backwards'}{each}, batched"
               + (f", then {verify} patched forwards{each}" if verify else ""))
    run = st.button("Run sweep", type="primary", disabled=None in ids, use_container_width=True)


def probability_of(answer: int):
    def probability_of_clean_answer(logits):  # a tensor from the logits: attribution patching differentiates it
        return logits[-1].double().softmax(-1)[answer]

    return probability_of_clean_answer


def dataset_metrics_and_answers():
    """(metrics, answers) for dataset_patching: the logit difference of each pair's answers, or the probability of
    each pair's clean answer."""
    if metric_name == "Logit difference":
        return None, pair_answers
    return [probability_of(probes.lens.token_id(model, clean_answer)) for clean_answer, _ in pair_answers], None


def metric_and_answers():
    """(metric, answers) for patching_sweep: its default logit difference, or one answer's probability."""
    if source == "A dataset":
        return dataset_metrics_and_answers()
    if metric_name == "Logit difference":
        if any(answers) and not all(answers):  # one alone would silently fall back to both top tokens
            missing = "Clean" if not answers[0] else "Corrupt"
            raise WorkbenchError(f"{missing} answer is empty: the logit difference needs both answers, or neither "
                                 "(each prompt's top token)")
        return None, (tuple(answers) if all(answers) else None)
    answer = probes.lens.token_id(model, answers[0]) if answers[0] else int(model.forward(clean)[-1].argmax())
    return probability_of(answer), None


if run:
    with common.guard():
        metric, answer_pair = metric_and_answers()
        sweep = dict(over=over, hook=hook, layers=layers, answers=answer_pair, normalize=normalize)
        if source == "A dataset":
            kind = "activation" if method == "Activation patching" else "attribution"
            result = common.with_progress("Patching", lambda report: hooks.dataset_patching(
                model, pairs, metric, method=kind, steps=steps, verify=verify, **sweep, progress=report))
        elif method == "Activation patching":
            result = common.with_progress("Patching", lambda report: hooks.patching_sweep(
                model, clean, corrupt, metric, **sweep, progress=report))
        else:
            result = hooks.attribution_patching(model, clean, corrupt, metric, **sweep, steps=steps, verify=verify)
        st.session_state.pt_result = result

result = st.session_state.get("pt_result")
if result is not None:
    st.subheader("Result", divider="gray")
    a, b, c = st.columns(3)
    a.metric("Clean metric", f"{result.clean_metric:.3f}")
    b.metric("Corrupt metric", f"{result.corrupt_metric:.3f}")
    c.metric("Grid", " × ".join(str(n) for n in result.grid.shape))
    over_pairs = f" · mean of {result.pairs} pairs" if result.pairs > 1 else ""
    st.caption(f"{result.method} · {result.metric_name} · {result.hook}{over_pairs}")
    height = 520 if len(result.over) == 2 else 260 * -(-result.grid.shape[2] // 4) + 120
    st.plotly_chart(common.style(result.figure(), height=height), key="pt_figure")
    verified = result.verified()
    if verified:
        st.caption("The cells of the largest estimated effect, patched")
        st.dataframe([{"cell": " ".join(cell["labels"]), "estimated": cell["estimated"], "patched": cell["patched"]}
                      for cell in verified], hide_index=True, use_container_width=True)
