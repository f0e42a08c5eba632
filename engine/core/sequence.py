"""A request as the control plane sees it: token ids, vLLM's token-count model, block table, timestamps.
Torch-free; ids come from the scheduler that admits the request, never from a class-level counter."""

from __future__ import annotations

import enum

from engine.sampling_params import SamplingParams


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
        copy_prompt: bool = True,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {seq_id}: the prompt is empty")
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        # copy_prompt=False: the caller's fresh list becomes the token list (it grows with the output)
        self.token_ids: list[int] = list(prompt_token_ids) if copy_prompt else prompt_token_ids
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
        # the stop tests of every step: length reached (capped at max_model_len by the scheduler), or
        # the token that ends it (-1: none; token ids are never negative)
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
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.REJECTED)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
