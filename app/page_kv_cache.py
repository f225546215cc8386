"""KV cache: prefill the prompt, look at the cache (layers x slots), edit it, continue generating."""
import streamlit as st

from workbench.app import common

st.header("KV cache")
st.caption("All prompt tokens but the last are prefilled into a cache; generation continues from the last "
           "token through the (edited) cache, next to a run through the untouched one.")
model = common.model()
ids = common.session_prompt_ids(model)
if ids is None:
    st.stop()
if len(ids) < 2:
    st.info("The KV cache page needs a prompt of at least two tokens.")
    st.stop()


def prefill(prefix: list[int]):
    cache = model.new_cache()
    model.forward(prefix, cache=cache)
    return cache


base = common.remember(("kv_prefill", tuple(ids)), lambda: prefill(ids[:-1]), "Prefilling the cache…")

# The surgery is a list of KVCache method calls, replayed on a clone of the prefilled cache.
common.forget_on_new_prompt("kv", ids, ["kv_ops", "kv_result", "kv_slots", "kv_length"])
ops: list[tuple[str, object]] = st.session_state.setdefault("kv_ops", [])


def apply(ops):
    cache = base.clone()
    for method, argument in ops:
        getattr(cache, method)(argument)
    return cache


def add(method: str, argument) -> None:
    """Button callback: keep the operation if it applies; the surgery widgets start afresh."""
    if common.attempt(apply, ops + [(method, argument)]) is not None:
        ops.append((method, argument))
    for key in ("kv_slots", "kv_length"):
        st.session_state.pop(key, None)


cache = apply(ops)
slot_labels = [f"{s} p{int(p)} {common.visible(t)}" for s, (p, t) in
               enumerate(zip(cache.positions.tolist(), model.token_texts(cache.tokens)))]

view, surgery = st.columns([3, 1], gap="large")
with surgery:
    st.subheader("Surgery", divider="gray")
    st.multiselect("Slots", range(cache.length), format_func=lambda s: slot_labels[s], key="kv_slots")
    st.button("Delete slots", use_container_width=True, disabled=not st.session_state.kv_slots,
              on_click=lambda: add("delete_positions", list(st.session_state.kv_slots)))
    st.number_input("Keep the first", 0, cache.length, cache.length, key="kv_length")
    st.button("Truncate", use_container_width=True,
              on_click=lambda: add("truncate", int(st.session_state.kv_length)))
    # a layer that reuses an earlier layer's keys and values has none to clear: its source is cleared instead
    st.selectbox("Layer", [i for i, source in enumerate(cache.kv_sources) if source == i], key="kv_layer")
    st.button("Clear layer", use_container_width=True,
              on_click=lambda: add("clear", int(st.session_state.kv_layer)))
    st.button("Reset", use_container_width=True, disabled=not ops, on_click=ops.clear)
    if ops:
        st.code("\n".join(f"cache.{m}({a!r})" for m, a in ops), language="python")

with view:
    st.markdown(f"**{cache.length} slots**, next position {cache.next_position}; generation continues from "
                f"`{common.visible(model.token_texts(ids[-1:])[0])}`")
    which = st.radio("Show", ["keys", "values"], horizontal=True, key="kv_which")
    if cache.length:
        index = 0 if which == "keys" else 1
        norms = [cache.get(source)[index].norm(dim=-1).mean(0).tolist() for source in cache.kv_sources]
        layer_labels = [f"L{i}" if source == i else f"L{i} (L{source}'s)" for i, source in enumerate(cache.kv_sources)]
        st.plotly_chart(common.heatmap(norms, slot_labels, layer_labels,
                                       colorbar=f"{which[:-1]} norm", colorscale="Cividis", x_title="cache slot",
                                       y_title="layer", value_format=".2f", height=640), key="kv_heatmap")
    else:
        st.info("The cache is empty.")

st.subheader("Continue generation", divider="gray")
n_new = st.slider("New tokens", 1, 48, 16, key="kv_new_tokens")
if st.button("Continue", type="primary"):
    with common.guard():
        baseline = common.remember(("kv_baseline", tuple(ids), n_new), lambda: common.generate(
            model, ids[-1:], n_new, "Untouched cache", cache=base.clone()), "Generating…")
        edited = common.generate(model, ids[-1:], n_new, "Edited cache", cache=cache.clone())
        st.session_state.kv_result = (list(ops), baseline, edited)
result = st.session_state.get("kv_result")
if result is not None:
    result_ops, baseline, edited = result
    left, right = st.columns(2)
    left.markdown("**Untouched cache**")
    left.code(baseline, language=None, wrap_lines=True)
    right.markdown(f"**Edited cache** ({len(result_ops)} operation{'s' * (len(result_ops) != 1)})")
    right.code(edited, language=None, wrap_lines=True)
