"""A request as the control plane sees it: token ids, vLLM's token-count model, block table, timestamps.

Torch-free and shared by the real engine and the simulator. Ids come from the scheduler that admits
the request (one counter per engine), never from a class-level counter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature: must be >= 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k: must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p: must be in (0, 1], got {self.top_p}")
        if self.max_tokens <= 0:
            raise ValueError(f"SamplingParams.max_tokens: must be >= 1, got {self.max_tokens}")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"


class Sequence:
    """One request. `num_computed_tokens` counts tokens whose KV is in the cache (prefix hits included)."""

    __slots__ = (
        "seq_id",
        "status",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_table",
        "block_hashes",
        "num_cached_blocks",
        "sampling_params",
        "max_tokens",
        "ignore_eos",
        "eos_token_id",
        "stop_num_tokens",
        "stop_token_id",
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "last_token_time",
        "finish_time",
        "num_preemptions",
        "finish_reason",
        "user_data",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float = 0.0,
        eos_token_id: int | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {seq_id}: the prompt is empty")
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # memo of the hash chain over full blocks of token_ids
        self.num_cached_blocks = 0  # leading blocks of block_table that are registered in the cache
        self.sampling_params = sampling_params
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.eos_token_id = eos_token_id
        # The stop tests of every step, precomputed: length reached, or the token that ends it (-1:
        # none; token ids are never negative). The scheduler caps stop_num_tokens at max_model_len.
        self.stop_num_tokens = self.num_prompt_tokens + self.max_tokens
        self.stop_token_id = -1 if self.ignore_eos or eos_token_id is None else eos_token_id
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.user_data: object = None  # caller's handle (e.g. the trace row), never read here

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.REJECTED)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )


# One row per finished (or rejected) request, shared by the simulator and the real-engine replay so
# that both are measured by the same metrics code.
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
