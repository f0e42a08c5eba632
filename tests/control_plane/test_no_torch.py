"""The control plane runs with torch and the simulator made unimportable (a fresh interpreter per
check), its sources import nothing of the repository but one another and SamplingParams, and its files
stay under their line budget."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTROL_PLANE = (
    "engine.core",
    "engine.core.config",
    "engine.core.sequence",
    "engine.core.block_manager",
    "engine.core.scheduler",
)
ALLOWED_OUTSIDE = {"engine.sampling_params"}  # the request's sampling parameters (nano-vllm, vLLM)
LINE_BUDGET = 1000

SCRIPT = textwrap.dedent(
    """
    import sys

    BLOCKED = ("torch", "simulator")

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked for this test: {name}")
            return None

    sys.meta_path.insert(0, Blocker())
    sys.path.insert(0, sys.argv[1])

    import engine
    import engine.core.block_manager
    import engine.core.config
    import engine.core.scheduler
    import engine.core.sequence
    from engine import BlockManager, SamplingParams, Scheduler, SchedulerConfig

    t = [0.0]
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), BlockManager(8, 4),
                      clock=lambda: t[0])
    seqs = [sched.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True)),
            sched.add_request([1, 2, 3, 4, 9, 9], SamplingParams(max_tokens=2, ignore_eos=True))]
    steps = 0
    while sched.has_unfinished() and steps < 100:
        batch = sched.schedule()
        t[0] += 1.0
        sched.postprocess(batch, [7] * batch.num_seqs)
        steps += 1
    assert [s.finish_reason for s in seqs] == ["length", "length"], seqs
    assert seqs[1].num_cached_tokens == 4
    loaded = [m for m in sys.modules if m.split(".")[0] in BLOCKED]
    assert not loaded, loaded
    print("ok", steps)
    """
)


def _path(module: str) -> Path:
    path = REPO.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imports(path: Path) -> set[str]:
    """Every module an import in `path` names, lazy ones inside functions too."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_control_plane_runs_without_torch_or_the_simulator():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok 3\n"  # a prefill step of both, then two decode steps


def test_the_hook_does_block_torch_and_the_simulator():
    """Guard against a vacuous pass: the same hook makes `import torch` and `import simulator` fail."""
    for name in ("torch", "simulator.fast_forward"):
        script = SCRIPT.split("import engine\n", 1)[0] + f"import {name}\n"
        proc = subprocess.run(
            [sys.executable, "-c", script, str(REPO)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode != 0
        assert f"blocked for this test: {name.split('.')[0]}" in proc.stderr


def test_control_plane_sources_import_only_the_standard_library_and_one_another():
    outside = {
        module: sorted(
            name
            for name in _imports(_path(module))
            if name.split(".")[0] not in sys.stdlib_module_names
            and name not in CONTROL_PLANE
            and name not in ALLOWED_OUTSIDE
        )
        for module in CONTROL_PLANE
    }
    assert outside == {module: [] for module in CONTROL_PLANE}


def test_the_control_plane_stays_under_its_line_budget():
    lines = {module: len(_path(module).read_text().splitlines()) for module in CONTROL_PLANE}
    assert sum(lines.values()) < LINE_BUDGET, lines
