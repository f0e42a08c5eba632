"""`kvplan dashboard`: start the Streamlit app (dashboard/app.py) in a subprocess, headless.

`register(subparsers)` is the plugin hook that simulator/cli.py calls; this module only builds the
`streamlit run` command line and imports no streamlit itself.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

APP = Path(__file__).resolve().parent / "app.py"


def streamlit_command(port: int = 8501, host: str = "127.0.0.1", extra: list[str] | None = None) -> list[str]:
    """The `python -m streamlit run` command line for the app (headless, no usage statistics)."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.headless=true",
        f"--server.port={port}",
        f"--server.address={host}",
        "--server.maxUploadSize=50",
        "--browser.gatherUsageStats=false",
        "--client.toolbarMode=minimal",
        "--server.fileWatcherType=none",
        *(extra or []),
    ]


def cmd_dashboard(args: argparse.Namespace) -> int:
    cmd = streamlit_command(args.port, args.host)
    print(f"kvplan dashboard: http://{args.host}:{args.port}  (Ctrl-C to stop)", file=sys.stderr)
    try:
        return subprocess.call(cmd, cwd=Path.cwd())
    except KeyboardInterrupt:
        return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dashboard", help="the Streamlit dashboard (what-if, capacity plan, sim vs real)"
    )
    p.add_argument("--port", type=int, default=8501, help="port the app listens on")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.set_defaults(func=cmd_dashboard)
