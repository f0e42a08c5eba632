"""Host time of one decode step's inputs (`build_step_inputs`), block tables rebuilt from every
sequence's list, gathered from the rows a `BlockTableRows` keeps, and gathered on the device from the
copy of those rows a `DeviceTableRows` keeps there (the engine's default).

Each shape decodes `--steps` steps of `batch` sequences of `context` tokens (a block opened where a
sequence's tokens cross one, as the block manager deals them), building each step's inputs for
`--device` (default: a GPU where there is one, through a pinned staging buffer as the engine does:
the host's part is the arrays, the staging copy and queueing the copy and the device's gather; on a
CPU the "device" gather runs on the host too). Prints per shape the median µs a step of each way,
thread CPU time. With `--tp-message`, also what rank 0 sends a
tensor-parallel worker each step (`engine.distributed.StepMessage`): pickled bytes and µs to build
and pickle it, whole tables against the blocks added since the step before (`TableDeltas`).
Not a test.

    python benchmarks/bench_step_inputs.py [--steps 64] [--shapes 1x1024x16,32x32768x16,...] [--tp-message]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.attention.metadata import BlockTableRows, DeviceTableRows, build_step_inputs  # noqa: E402
from engine.core.config import cdiv  # noqa: E402
from engine.core.scheduler import make_batch  # noqa: E402
from engine.core.sequence import Sequence  # noqa: E402
from engine.distributed import StepMessage, TableDeltas  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

# (batch, context tokens, block size): the single stream; four block-16 batches of about 1M context
# tokens (a full H200 cache of Qwen3-0.6B), from long sequences to many; the nano-vllm recipe's
# widest decode at block 256
DEFAULT_SHAPES = "1x1024x16,32x32768x16,64x16384x16,128x8192x16,256x4096x16,256x4096x256"


def decode_batch(seqs: list[Sequence], block_size: int, next_block: list[int]):
    """The next decode step of `seqs`: each appends a token (a new block where it opens one)."""
    for seq in seqs:
        c = len(seq.token_ids)
        seq.token_ids.append(0)
        seq.num_computed_tokens = c
        if c % block_size == 0:
            seq.block_table.append(next_block[0])
            next_block[0] += 1
    n = len(seqs)
    return make_batch(seqs, [1] * n, [s.num_computed_tokens for s in seqs], [0] * n, [], 0, n)


def make_seqs(batch: int, context: int, block_size: int) -> list[Sequence]:
    """`batch` sequences of `context` - 1 tokens, each holding the blocks of its tokens."""
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    nb = cdiv(context, block_size)
    seqs = []
    for i in range(batch):
        seq = Sequence(i, [0] * (context - 1), params, 0.0)
        seq.block_table = list(range(i * nb, (i + 1) * nb))
        seqs.append(seq)
    return seqs


WARMUP_STEPS = 4  # the first steps write every row (and send every table whole): not timed


def time_steps(batch: int, context: int, block_size: int, steps: int, work, after=None) -> tuple[float, list]:
    """Decode `steps` (+ warm-up) steps of `batch` sequences of `context` tokens, calling `work(batch)`
    on each (then `after()`, untimed, where given): the median thread-CPU µs of a call, and what the
    timed calls returned."""
    seqs = make_seqs(batch, context, block_size)
    next_block, times, results = [batch * cdiv(context, block_size)], [], []
    for step in range(steps + WARMUP_STEPS):
        b = decode_batch(seqs, block_size, next_block)
        t0 = time.thread_time()
        result = work(b)
        if step >= WARMUP_STEPS:
            times.append(time.thread_time() - t0)
            results.append(result)
        if after is not None:
            after()
    return statistics.median(times) * 1e6, results


def time_message(batch: int, context: int, block_size: int, steps: int, deltas: bool) -> tuple[float, int]:
    """Median thread-CPU µs to build and pickle one step's worker message, and its median bytes."""
    tables = TableDeltas(4 * batch) if deltas else None

    def message(b) -> int:
        return len(pickle.dumps(StepMessage.from_batch(b, tables), protocol=pickle.HIGHEST_PROTOCOL))

    us, sizes = time_steps(batch, context, block_size, steps, message)
    return us, int(statistics.median(sizes))


MODES = ("rebuilt", "rows", "device rows")


def time_shape(
    batch: int, context: int, block_size: int, steps: int, mode: str, device: torch.device
) -> float:
    """Median thread-CPU µs of one step's `build_step_inputs`, its tables built the `mode` way."""
    width = cdiv(context + steps + WARMUP_STEPS, block_size)
    table_rows = {
        "rebuilt": None,
        "rows": BlockTableRows(2 * batch, width),
        "device rows": DeviceTableRows(2 * batch, width, device),
    }[mode]
    cuda = device.type == "cuda"
    staging = (
        torch.empty(2 * batch * width + 16 * batch, dtype=torch.int32, pin_memory=True) if cuda else None
    )
    us, _ = time_steps(
        batch,
        context,
        block_size,
        steps,
        lambda b: build_step_inputs(b, block_size, device, staging, table_rows),
        torch.cuda.synchronize if cuda else None,  # the staging buffer is free again
    )
    return us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="BATCHxCONTEXTxBLOCK, comma-separated")
    ap.add_argument("--tp-message", action="store_true", help="also time a tensor-parallel worker's message")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"device {device}")
    print(
        f"{'batch':>6} {'context':>8} {'block':>6} {'width':>6}" + "".join(f"{m + ' µs':>15}" for m in MODES)
    )
    for shape in args.shapes.split(","):
        batch, context, block_size = (int(x) for x in shape.split("x"))
        us = [time_shape(batch, context, block_size, args.steps, mode, device) for mode in MODES]
        width = cdiv(context, block_size)
        print(f"{batch:>6} {context:>8} {block_size:>6} {width:>6}" + "".join(f"{u:>15.0f}" for u in us))
    if args.tp_message:
        print(
            f"\n{'batch':>6} {'context':>8} {'block':>6} {'whole µs':>9} {'bytes':>9} {'deltas µs':>10} {'bytes':>7}"
        )
        for shape in args.shapes.split(","):
            batch, context, block_size = (int(x) for x in shape.split("x"))
            whole_us, whole_b = time_message(batch, context, block_size, args.steps, deltas=False)
            delta_us, delta_b = time_message(batch, context, block_size, args.steps, deltas=True)
            print(
                f"{batch:>6} {context:>8} {block_size:>6} {whole_us:>9.0f} {whole_b:>9,} {delta_us:>10.0f} {delta_b:>7,}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
