"""When one simulation run stands for other configurations: capacity limits that it never reached.

Configurations that differ only in max_num_seqs (M), max_num_batched_tokens (B) and KV blocks per
replica (N: set, or sized from memory) schedule alike wherever the run meets none of those limits;
`shares_run` says when a finished run shows that, and `derive` reports the run as another such
configuration. No scheduling here, no running: sweep.py asks, the run is sim.py's.
"""

from __future__ import annotations

import dataclasses

from engine.core.block_manager import ROOT_HASH
from simulator.config import SimConfig
from simulator.metrics import SLO
from simulator.sim import SIM_TOKEN_ID, SimRun

# SimConfig fields that set capacity limits only (a point's axes of the same names).
CAPACITY_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "gpu_memory_utilization")


def prefix_neutral(prompts: list[list[int]], block_size: int) -> bool:
    """Whether no two requests' first blocks share a hash (each prompt's first `block_size` tokens,
    padded with the token every simulated decode samples, as a block that decodes fill holds them).

    Then no prefix-cache lookup or registration ever finds a hash: each request's first-block hash
    is registered by itself only, so every chain after it stays lazy (simulator/lazy_blocks.py) and
    no deeper block is ever registered; and without preemption no request is looked up twice. Which
    blocks stay cached, and for how long (N), then decides nothing."""
    pad = [SIM_TOKEN_ID] * block_size
    hashes = {hash((ROOT_HASH, tuple((p[:block_size] + pad)[:block_size]))) for p in prompts}
    return len(hashes) == len(prompts)


def shares_run(run: SimRun, config: SimConfig, num_kv_blocks: int, prefix_neutral: bool) -> bool:
    """Whether `config`, with `num_kv_blocks` KV blocks per replica, schedules every step as `run` did.

    `prefix_neutral`: `prefix_neutral` of the run's prompts (or prefix caching is off). Besides, the
    two configurations must be equal but for CAPACITY_FIELDS and synchronous, and the run must have
    met no limit of either (its `CapacityUse`: S* running requests at most, T* tokens a step, Q*
    blocks that its unfinished requests could hold at once):
    - M > S*: `len(running) < M` wherever admission or `waiting_blocked` asks;
    - N >= Q*: a request's blocks never exceed its prompt + output tokens, so every allocation,
      preemption check, run cap and admission test asks for at most Q* minus the blocks in use (no
      request is rejected for the cache's size either: Q* counts every arrival's blocks);
    - B the same, or B > T* for both: no grant was cut or refused for budget (a step's T* counts
      the head left waiting after it, whom a larger budget would have admitted).
    Where none of these decides, the scheduler's choices are those of unbounded limits: the same
    steps at the same times, the same finished requests; only the block ids differ, and the KV
    usage of the timeline, which `derive` divides by this configuration's N.
    """
    base = run.config
    if base.async_scheduling or config.async_scheduling:
        return False  # (not analysed: requests wait in the replica's inbox)
    if dataclasses.replace(config, **{f: getattr(base, f) for f in CAPACITY_FIELDS}) != base:
        return False
    if not (prefix_neutral or not base.enable_prefix_caching):
        return False
    uses = [replica.capacity for replica in run.replicas]
    if any(r.scheduler.num_preemptions for r in run.replicas) or any(u.num_empty_steps for u in uses):
        return False
    max_running = max(u.max_running for u in uses)
    max_tokens = max(u.max_step_tokens for u in uses)
    max_blocks = max(u.max_kv_blocks for u in uses)
    for seqs, blocks in ((base.max_num_seqs, run.num_kv_blocks), (config.max_num_seqs, num_kv_blocks)):
        if seqs <= max_running or blocks < max_blocks:
            return False
    budgets = (base.max_num_batched_tokens, config.max_num_batched_tokens)
    return budgets[0] == budgets[1] or min(budgets) > max_tokens


def derive(run: SimRun, config: SimConfig, num_kv_blocks: int, slo: SLO | None = None):
    """The SimResult of `config` from a run that `shares_run` says it shares."""
    from simulator.run import collect

    source = "config" if config.num_kv_blocks is not None else "gpu_memory"
    extra = {**run.extra, "kv_blocks_source": source}
    return collect(dataclasses.replace(run, config=config, num_kv_blocks=num_kv_blocks, extra=extra), slo)
