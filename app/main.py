"""The workbench dashboard: ``workbench app [--model PATH] [--port N]`` runs ``streamlit run`` on this file."""
import streamlit as st

import workbench
from workbench.app import common

st.set_page_config(page_title="workbench", page_icon=":material/biotech:", layout="wide")
common.keep_widget_values()

PAGES = [
    st.Page("page_run_lens.py", title="Run & lens", icon=":material/layers:", default=True),
    st.Page("page_attention.py", url_path="attention", title="Attention", icon=":material/grid_on:"),
    st.Page("page_interventions.py", url_path="interventions", title="Interventions", icon=":material/tune:"),
    st.Page("page_patching.py", url_path="patching", title="Patching", icon=":material/swap_horiz:"),
    st.Page("page_batch.py", url_path="batch", title="Batch", icon=":material/view_list:"),
    st.Page("page_adapters.py", url_path="adapters", title="Adapters", icon=":material/difference:"),
    st.Page("page_probes.py", url_path="probes", title="Probes", icon=":material/scatter_plot:"),
    st.Page("page_sae.py", url_path="sae", title="SAE features", icon=":material/blur_on:"),
    st.Page("page_kv_cache.py", url_path="kv-cache", title="KV cache", icon=":material/memory:"),
    st.Page("page_experts.py", url_path="experts", title="Experts", icon=":material/hub:"),
    st.Page("page_artifacts.py", url_path="artifacts", title="Artifacts", icon=":material/inventory_2:"),
]

page = st.navigation(PAGES)
common.page_style()
# The whole server computes in one numerics (``workbench app --numerics``): each run of this script, in its own
# thread, computes in them.
numerics = common.cli_options().numerics
with workbench.kernels.numerics(numerics):
    model = common.model()
    with st.sidebar:
        c = model.config
        st.caption(f"**{c.name}** · {c.n_layers} layers · d_model {c.d_model} · {c.n_heads} heads · "
                   f"{str(model.device)} {str(model.dtype).removeprefix('torch.')} · {numerics} numerics")
    common.prompt_inputs()
    with common.guard():
        page.run()
