"""AppTest helpers for the dashboard page tests: build the app, switch pages, read charts by key.
Not a test module."""

from __future__ import annotations

import json
from pathlib import Path

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")


def app_on(page: str, timeout: float = 120.0, **state: object) -> AppTest:
    """The app switched to `app_pages/<page>.py` with `state` preset in session_state, run once."""
    at = AppTest.from_file(APP, default_timeout=timeout)
    for key, value in state.items():
        at.session_state[key] = value
    at.switch_page(f"app_pages/{page}.py")
    at.run()
    return at


def charts(at: AppTest) -> dict[str, dict]:
    """The page's plotly charts as {widget key: figure spec}."""
    out = {}
    for el in at.get("plotly_chart"):
        key = el.proto.id.split("-", 2)[-1]
        out[key] = json.loads(el.proto.spec)
    return out


def no_exceptions(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def texts(elements) -> list[str]:
    return [str(e.value) for e in elements]


def button(at: AppTest, label: str):
    return next(b for b in at.button if b.label == label)


def frame(at: AppTest, column: str):
    """The first table on the page with a column (or index) named `column`, as a DataFrame."""
    for df in at.dataframe:
        value = df.value
        if column in value.columns or column == value.index.name:
            return value
    raise KeyError(f"no table with a column {column!r}")
