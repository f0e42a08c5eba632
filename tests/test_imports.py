"""Import structure: no library module imports a command-line module, and the command lines do not
import each other (traces/cli.py holds what they share). Read from the source, not by importing."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "simulator", "traces", "dashboard")
CLI_MODULES = {
    "engine.cli",
    "simulator.cli",
    "simulator.plan_cli",
    "simulator.profile_cli",
    "traces.cli",
    "dashboard.cli",
}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def _imports(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in `path` names (lazy ones inside functions too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _sources():
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            yield _module(path), _imports(path)


def test_library_modules_import_no_command_line():
    found = {
        module: sorted(imported & CLI_MODULES)
        for module, imported in _sources()
        if module not in CLI_MODULES and imported & CLI_MODULES
    }
    assert found == {}


def test_command_lines_import_only_the_shared_trace_helpers():
    """A command line imports no other but traces/cli.py (what they share); simulator/plan_cli.py,
    the second half of simulator's, also uses simulator/cli.py's helpers. simulator/cli.py finds the
    other command lines by name (`_PLUGINS`), so none imports another."""
    found = {
        module: sorted(imported & (CLI_MODULES - {module, "traces.cli"}))
        for module, imported in _sources()
        if module in CLI_MODULES - {"simulator.plan_cli"}
    }
    assert found == {module: [] for module in CLI_MODULES - {"simulator.plan_cli"}}


def test_the_engine_imports_nothing_of_the_simulator():
    """engine/ stands alone: what joins it to the simulator (the sweep's estimate, the fit, the
    profile: simulator/calibration.py, `kvplan profile`: simulator/profile_cli.py) lives there."""
    found = {
        module: sorted(name for name in imported if name == "simulator" or name.startswith("simulator."))
        for module, imported in _sources()
        if module.split(".")[0] == "engine"
    }
    assert {module: names for module, names in found.items() if names} == {}
    assert "engine.profiling" in found and "engine.cli" in found  # every engine module was read
