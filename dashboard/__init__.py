"""kvplan dashboard: a Streamlit app of thin pages over `simulator/` and `traces/`.

`dashboard.app` is the entry point (`kvplan dashboard`); pure helpers live in `dashboard.logic`,
plotly figure builders in `dashboard.figures`. Importing this package imports no streamlit.
"""
