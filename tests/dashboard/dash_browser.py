"""Test helpers, not tests: run `streamlit run dashboard/app.py` on a free loopback port and drive
headless Chromium over the DevTools protocol (websockets' sync client) to load a page, wait until
Streamlit has rendered it, and read it or screenshot it. Run as a script to regenerate
docs/screenshots/*.png: `python tests/dashboard/dash_browser.py`.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_NAMES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
)
# Runs in the page: what Streamlit shows in the main area (all of it, and outside charts: plotly
# may redraw its axes at any time), the script's run state (stApp's data-test-script-state,
# "notRunning" when idle), stale elements, chart count, exception boxes and error dialogs.
_PROBE_JS = """(() => {
  const app = document.querySelector('[data-testid="stApp"]');
  const main = document.querySelector('[data-testid="stMain"]');
  const charts = '[data-testid="stPlotlyChart"], .js-plotly-plot';
  const parts = [];
  if (main) {
    const walker = document.createTreeWalker(main, NodeFilter.SHOW_TEXT, {acceptNode: n =>
      n.parentElement && n.parentElement.closest(charts) ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT});
    while (walker.nextNode()) parts.push(walker.currentNode.nodeValue);
  }
  return JSON.stringify({
    text: main ? main.innerText : "",
    widgets_text: parts.join("|"),
    script: app ? app.getAttribute("data-test-script-state") : null,
    stale: document.querySelectorAll('[data-stale="true"]').length,
    skeleton: document.querySelectorAll('[data-testid="stSkeleton"]').length,
    exceptions: [...document.querySelectorAll('[data-testid="stException"]')].map(e => e.innerText)
      .concat([...document.querySelectorAll('[role="dialog"]')].map(e => e.innerText)
        .filter(t => /not found|error/i.test(t))),
    charts: document.querySelectorAll('[data-testid="stPlotlyChart"]').length,
  });
})()"""


# Runs in the page: only the script's run state, cheap enough to poll while a run computes (the full
# probe reads all text, which lays the page out: on a 2-core machine it competes with the run).
_RUN_STATE_JS = """(() => { const app = document.querySelector('[data-testid="stApp"]');
  return app ? app.getAttribute("data-test-script-state") : null; })()"""


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    """A free TCP port on the loopback interface (bind to port 0 and let the kernel pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process we started (its own process group), by id."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def streamlit_server(env: dict[str, str] | None = None, timeout: float = 60.0) -> Iterator[str]:
    """Start the dashboard (as `kvplan dashboard` does) on a free loopback port; yields its base URL."""
    from dashboard.cli import streamlit_command

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            streamlit_command(port, "127.0.0.1"),
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout
            while not _healthy(url):
                if proc.poll() is not None:
                    log.seek(0)
                    output = log.read().decode(errors="replace")
                    raise RuntimeError(f"streamlit exited with {proc.returncode}:\n{output}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"streamlit did not answer on {url} within {timeout:.0f} s")
                time.sleep(0.25)
            yield url
        finally:
            _stop(proc)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class PageState:
    """What a loaded page shows: main-area text, exception boxes, chart count, seconds to render."""

    text: str
    exceptions: list[str] = field(default_factory=list)
    charts: int = 0
    seconds: float = 0.0


class Browser:
    """Headless Chromium with one tab, driven over the DevTools protocol."""

    def __init__(self, chromium: str | None = None, width: int = 1400, height: int = 1000) -> None:
        from websockets.sync.client import connect

        self._tmp = tempfile.TemporaryDirectory(prefix="kvplan-chromium-")
        self._stack = contextlib.ExitStack()
        exe = chromium or find_chromium()
        if exe is None:
            raise FileNotFoundError("no chromium found (apt-get install chromium)")
        self.proc = subprocess.Popen(
            [
                exe,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={self._tmp.name}",
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            port = self._devtools_port()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                targets = json.loads(r.read())
            page = next(t for t in targets if t.get("type") == "page")
            self.ws = self._stack.enter_context(
                connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=10)
            )
        except BaseException:
            self.close()
            raise
        self._id = 0
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.resize(width, height)

    def _devtools_port(self, timeout: float = 20.0) -> int:
        path = Path(self._tmp.name) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.is_file():
                first = path.read_text().splitlines()[:1]
                if first and first[0].strip().isdigit():
                    return int(first[0])
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            time.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    def call(self, method: str, timeout: float = 30.0, **params: object) -> dict:
        self._id += 1
        msg_id = self._id
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            raw = self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01))
            msg = json.loads(raw)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def resize(self, width: int, height: int) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def probe(self) -> dict:
        out = self.call("Runtime.evaluate", expression=_PROBE_JS, returnByValue=True)
        return json.loads(out["result"]["value"])

    def run_state(self) -> str | None:
        """The script's run state alone ("running", "notRunning", ...): a cheap probe."""
        return self.call("Runtime.evaluate", expression=_RUN_STATE_JS, returnByValue=True)["result"].get(
            "value"
        )

    def load(self, url: str, ready_text: str, timeout: float = 60.0, settle: float = 1.0) -> PageState:
        """Open `url` and wait until the page shows `ready_text` (see `wait`)."""
        self.call("Page.navigate", url=url)
        return self.wait(ready_text, timeout, settle)

    def wait(self, ready_text: str, timeout: float = 60.0, settle: float = 1.0) -> PageState:
        """Wait until the main area shows `ready_text`, no script run is in progress and the text has
        not changed for `settle` seconds, or an exception box shows. `seconds`: until it was ready."""
        t0 = time.monotonic()
        last, stable_since = None, None
        while True:
            if self.run_state() == "running" and time.monotonic() - t0 < timeout:
                time.sleep(0.1)  # a run is computing: poll the cheap way until it ends
                continue
            state = self.probe()
            now = time.monotonic()
            if state["exceptions"]:
                return PageState(state["text"], state["exceptions"], state["charts"], now - t0)
            idle = state["script"] == "notRunning" and not state["stale"] and not state["skeleton"]
            ready = idle and ready_text in state["text"]
            key = (state["widgets_text"], state["charts"])
            if not ready:
                stable_since = None
            elif key != last or stable_since is None:
                stable_since = now
            elif now - stable_since >= settle:
                return PageState(state["text"], [], state["charts"], stable_since - t0)
            last = key
            if now - t0 > timeout:
                raise TimeoutError(
                    f"not rendered within {timeout:.0f} s (script {state['script']}, {state['stale']} stale, "
                    f"{state['skeleton']} skeletons); the page shows:\n{state['text'][:2000]}"
                )
            time.sleep(0.2)

    def started(self, timeout: float = 5.0) -> bool:
        """Wait until a script run starts (after an interaction); False if none started in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.probe()["script"] != "notRunning":
                return True
            time.sleep(0.05)
        return False

    def click(self, label: str) -> None:
        """Click the first button whose text is `label` and wait for the script run it starts."""
        js = (
            "(() => { const b = [...document.querySelectorAll('button')]"
            f".find(b => b.innerText.trim() === {json.dumps(label)}); if (b) b.click(); return !!b; }})()"
        )
        if not self.call("Runtime.evaluate", expression=js, returnByValue=True)["result"].get("value"):
            raise LookupError(f"no button {label!r}")
        self.started()

    def set_input(self, label: str, value: str) -> None:
        """Type `value` into the text or number input labelled `label`, press Enter, and wait for the
        script run it starts."""
        js = f"""(() => {{
          const input = [...document.querySelectorAll('input')]
            .find(i => i.getAttribute('aria-label') === {json.dumps(label)});
          if (!input) return false;
          const setter = Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set;
          input.focus();
          setter.call(input, {json.dumps(value)});
          input.dispatchEvent(new Event('input', {{bubbles: true}}));
          input.dispatchEvent(new KeyboardEvent('keydown', {{key: 'Enter', code: 'Enter', keyCode: 13, bubbles: true}}));
          input.blur();
          return true;
        }})()"""
        if not self.call("Runtime.evaluate", expression=js, returnByValue=True)["result"].get("value"):
            raise LookupError(f"no input {label!r}")
        self.started()

    def screenshot(self, path: str | Path, width: int = 1000, max_height: int = 3200) -> Path:
        """Save the whole page (the viewport grown to the content's height) as a small PNG, scaled to
        `width` px with a 256-colour palette."""
        from PIL import Image

        js = "document.querySelector('[data-testid=\"stMain\"]').scrollHeight"
        metrics = self.call("Page.getLayoutMetrics")["cssLayoutViewport"]
        full = int(self.call("Runtime.evaluate", expression=js, returnByValue=True)["result"]["value"])
        view_w, view_h = int(metrics["clientWidth"]), int(metrics["clientHeight"])
        if full > view_h:
            self.resize(view_w, min(full + 40, max_height))
            time.sleep(1.5)  # let the charts re-lay out
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        self.resize(view_w, view_h)
        img = Image.open(io.BytesIO(data)).convert("RGB")
        if img.width > width:
            img = img.resize((width, round(img.height * width / img.width)), Image.LANCZOS)
        img = img.quantize(colors=256, method=Image.Quantize.MEDIANCUT)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        img.save(path, optimize=True)
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stack.close()
        _stop(self.proc)
        self._tmp.cleanup()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Page url path ("" = the default page) -> text that shows once the page has rendered its results.
PAGES = {
    "": "Arrival rate",
    "whatif": "Best configuration by",  # shown once the comparison has run, best or not
    "capacity": "Capacity plan",
    "validation": "Per-metric error",
    "profile": "Decode step time",
}


def make_screenshots(out_dir: Path = ROOT / "docs" / "screenshots") -> list[Path]:
    """Render every page with its defaults (validation: a generated sample run) and save PNGs."""
    from dash_samples import write_pair_run

    written = []
    with tempfile.TemporaryDirectory() as tmp:
        write_pair_run(Path(tmp) / "sample-run", num_requests=400)
        env = {"KVPLAN_VALIDATION_DIR": tmp}
        with streamlit_server(env) as url, Browser(height=1300) as browser:
            for page, ready in PAGES.items():
                state = browser.load(f"{url}/{page}", ready, timeout=180)
                if page == "capacity":  # show a plan, not the empty form
                    browser.click("Plan")
                    state = browser.wait("Recommended", timeout=300)
                if state.exceptions:
                    raise RuntimeError(f"{page}: {state.exceptions[0]}")
                written.append(browser.screenshot(out_dir / f"{page or 'traffic'}.png"))
                print(
                    f"{page or 'traffic'}: rendered in {state.seconds:.1f} s -> {written[-1]}",
                    file=sys.stderr,
                )
    return written


if __name__ == "__main__":
    make_screenshots()
