"""The rows a run leaves: one per engine step (StepRecorder writes them, the fitted latency model reads
them) and one per request (the real-engine replay and the simulator, measured by the same metrics).

Torch-free column lists and a row builder; not part of the control plane, which never reads them.
"""

from __future__ import annotations

from engine.core.sequence import Sequence

# One row per engine step: the batch totals, plus how the step ran and what it cost.
STEP_RECORD_COLUMNS = (
    "step",
    "kind",
    "num_seqs",
    "num_prefill_seqs",
    "num_decode_seqs",
    "total_num_scheduled_tokens",
    "num_prefill_tokens",
    "total_num_cached_tokens",
    "num_context_tokens",
    "max_seq_len",
    "prefill_attn_work",
    "num_kv_blocks_used",
    "graph_batch_size",
    "tp",
    "block_size",
    "gpu_time_s",
    "wall_time_s",
    "compiled",
    "allreduce_time_s",
    "idle_before_s",
    "graph_num_tokens",
    "overlapped",
    "num_waiting",
)

# One row per finished (or rejected) request.
REQUEST_FIELDS = (
    "request_id",
    "replica",
    "arrival_s",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "prompt_len",
    "output_len",
    "num_output_tokens",
    "num_preemptions",
    "num_cached_tokens",
    "finish_reason",
)


def request_record(
    seq: Sequence, request_id: int, output_len: int, replica: int = 0, t0: float = 0.0
) -> tuple:
    """The REQUEST_FIELDS row of `seq`, its times in seconds after `t0`."""

    first_scheduled, first_token, finish = seq.first_scheduled_time, seq.first_token_time, seq.finish_time
    return (
        request_id,
        replica,
        None if seq.arrival_time is None else seq.arrival_time - t0,
        None if first_scheduled is None else first_scheduled - t0,
        None if first_token is None else first_token - t0,
        None if finish is None else finish - t0,
        seq.num_prompt_tokens,
        output_len,
        seq.num_output_tokens,
        seq.num_preemptions,
        seq.num_cached_tokens,
        seq.finish_reason,
    )
