"""Host time of eager steps with and without a frozen garbage collector, in one engine process.

Random-weight Qwen3-0.6B, block 16, `LLM(freeze_gc=False)`: times steps with a fresh 1,024-token
prefill and steps with a 1,000-token one (4 decodes run throughout), then calls gc.freeze() (what
`LLM(freeze_gc=True)` does after start-up) and times them again; prints ms per step and the
collections each ran. Not run yet (written when the session's device time was spent).

    PYTHONPATH=. python3 benchmarks/bench_gc_freeze.py [--steps 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import gc
import random

from profile_decode import random_llm  # benchmarks/ is the script's folder
from profile_prefill import fresh_prompt, run_steps

from engine.sequence import SamplingParams


def timed(llm, rng: random.Random, shape: str, steps: int) -> tuple[float, list[int]]:
    """(wall ms per step, collections per generation) over `steps` steps of `shape`."""
    before = [s["collections"] for s in gc.get_stats()]
    wall = run_steps(llm, rng, shape, steps)
    return wall, [s["collections"] - b for s, b in zip(gc.get_stats(), before)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm = random_llm(16, freeze_gc=False)
    rng = random.Random(0)
    for _ in range(4):
        llm.add_request(
            fresh_prompt(rng, 200), SamplingParams(temperature=0, ignore_eos=True, max_tokens=10**5)
        )
    llm.step()
    print(f"tracked objects after start-up: {len(gc.get_objects()):,}")
    rows = []
    for frozen in (False, True):
        if frozen:
            gc.freeze()
        for shape in ("prefill_1024", "mixed_4+1000"):
            timed(llm, rng, shape, 3)  # warm
            for r in range(args.rounds):
                wall, cols = timed(llm, rng, shape, args.steps)
                rows.append((frozen, shape, r, wall, cols))
    llm.close()
    print(f"{'gc frozen':<10} {'step':<14} {'round':>5} {'ms/step':>8}  collections (gen 0/1/2)")
    for frozen, shape, r, wall, cols in rows:
        print(f"{str(frozen):<10} {shape:<14} {r:>5} {wall:>8.2f}  {cols}")


if __name__ == "__main__":
    main()
