"""pytest setup for the control-plane tests: make the repository root and this folder importable.

The package is not installed in the venv and this folder has no `__init__.py`, so the repository root
(for `engine`) and this folder (for the shared `cp_helpers`) go on `sys.path` here.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parents[1], _HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
