"""kvplan's Streamlit entry point: page config and navigation only (`streamlit run dashboard/app.py`,
or `kvplan dashboard`). Each page lives in dashboard/app_pages/ and is a thin layer of widgets over
`simulator/` and `traces/`, with figures from `dashboard.figures`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `streamlit run` puts dashboard/ on the path, not the repository root
    sys.path.insert(0, str(ROOT))

PAGES = Path(__file__).resolve().parent / "app_pages"

st.set_page_config(page_title="kvplan", page_icon=":material/memory:", layout="wide")
navigation = st.navigation(
    [
        st.Page(
            PAGES / "traffic.py",
            title="Traffic",
            icon=":material/timeline:",
            url_path="traffic",
            default=True,
        ),
        st.Page(PAGES / "whatif.py", title="What-if", icon=":material/compare_arrows:", url_path="whatif"),
        st.Page(PAGES / "capacity.py", title="Capacity plan", icon=":material/savings:", url_path="capacity"),
        st.Page(PAGES / "validation.py", title="Sim vs real", icon=":material/rule:", url_path="validation"),
        st.Page(PAGES / "profile.py", title="Engine profile", icon=":material/speed:", url_path="profile"),
    ]
)
st.sidebar.caption(
    "kvplan: capacity planning for LLM serving. The simulator replays traces through the engine's scheduler."
)
from dashboard import state  # noqa: E402  (after the path fix above)

state.keep_widget_state()  # the pages' settings survive a switch to another page
state.warm_pool()  # start simulation workers while the first page renders
navigation.run()
