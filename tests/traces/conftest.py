"""pytest setup for the traces tests: the repository root goes on sys.path, plus small file helpers."""

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


@pytest.fixture
def write(tmp_path):
    """write(name, text) -> Path of a new file under tmp_path with exactly that text."""

    def _write(name: str, text: str) -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return _write
