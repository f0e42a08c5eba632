"""End to end: `streamlit run dashboard/app.py` on a free loopback port, every page loaded in headless
Chromium (Debian `chromium`); fails on any exception shown on a page. Skipped without Chromium."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("streamlit")
pytest.importorskip("plotly")
from dash_browser import PAGES, Browser, find_chromium, streamlit_server
from dash_samples import write_pair_run

pytestmark = pytest.mark.skipif(find_chromium() is None, reason="needs chromium (apt-get install chromium)")


def test_every_page_renders_in_chromium(tmp_path):
    write_pair_run(tmp_path / "sample-run", num_requests=150)
    env = {
        "KVPLAN_VALIDATION_DIR": str(tmp_path),
        "KVPLAN_DASHBOARD_WORKERS": "2",
        "KVPLAN_DASHBOARD_WINDOW_S": "60",  # what-if on the first minute of azure_conv_2023 (~300 requests)
    }
    seconds = {}
    with streamlit_server(env) as url, Browser() as browser:
        for page, ready in PAGES.items():
            state = browser.load(f"{url}/{page}", ready, timeout=180)
            _check(page, state)
            assert state.charts > 0 or page == "capacity", f"{page} shows no chart"
            seconds[page] = state.seconds
        # A real interaction: a new rate scale re-simulates and re-renders the comparison.
        browser.load(f"{url}/whatif", PAGES["whatif"], timeout=180)
        browser.set_input("Rate scale (x faster)", "2")
        browser.wait(PAGES["whatif"], timeout=180)
        browser.click("Compare")  # the form simulates on Compare (Enter may have pressed it already)
        state = browser.wait(PAGES["whatif"], timeout=180)
        _check("whatif after an edit", state)
        assert "at 2x" in state.text
    print("seconds to render:", {k: round(v, 1) for k, v in seconds.items()}, file=sys.stderr)


def _check(page: str, state) -> None:
    assert not state.exceptions, f"{page}: {state.exceptions[0]}"
    assert "Traceback" not in state.text, f"{page}: {state.text[:2000]}"
