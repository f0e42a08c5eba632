"""The control plane imports and runs with torch made unimportable (a fresh interpreter per check)."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"blocked for this test: {name}")
            return None

    sys.meta_path.insert(0, NoTorch())
    sys.path.insert(0, sys.argv[1])

    import engine
    import engine.block_manager
    import engine.config
    import engine.scheduler
    import engine.sequence
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
    assert "torch" not in sys.modules, "torch was imported"
    assert not [m for m in sys.modules if m.startswith("torch.")]
    print("ok", steps)
    """
)


def test_control_plane_runs_without_torch():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok ")


def test_the_hook_does_block_torch():
    """Guard against a vacuous pass: the same hook makes `import torch` fail."""
    script = SCRIPT.split("import engine\n", 1)[0] + "import torch\n"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(REPO)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "blocked for this test: torch" in proc.stderr
