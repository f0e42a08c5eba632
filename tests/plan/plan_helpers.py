"""Shared helpers for the planning tests: a stub latency model with known step times, small traces.

Imported by the test modules of this folder (pytest puts it on sys.path).
"""

from __future__ import annotations

from collections.abc import Mapping

import traces
from simulator.latency.base import StepTime
from simulator.latency.gpus import get_gpu


class ConstantLatency:
    """Every non-empty step takes `step_s` seconds (decode steps too)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def predict(self, batch) -> StepTime:
        s = self.step_s if batch.num_seqs else 0.0
        return StepTime(0.0, 0.0, 0.0, 0.0, s)

    def decode_step_time(self, num_seqs: int, num_context_tokens: int, max_seq_len: int) -> float:
        return self.step_s


class StubByGpu:
    """A latency factory: the step time of a config's GPU type, divided by its TP degree."""

    def __init__(self, step_s: Mapping[str, float]) -> None:
        self.step_s = {get_gpu(k).name: v for k, v in step_s.items()}

    def __call__(self, config) -> ConstantLatency:
        return ConstantLatency(self.step_s[get_gpu(config.gpu).name] / config.tensor_parallel_size)


def one_token_trace(rate: float = 1.0, n: int = 100) -> traces.Trace:
    """Constant arrivals 1/rate apart; 16-token prompts, one output token: with max_num_seqs=1 and a
    ConstantLatency of s seconds each request is exactly one step, so a replica serves 1/s req/s and
    request i's TTFT is s + i (s - 1/rate) once overloaded."""
    return traces.generate(
        {"arrival": "constant", "rate": rate, "num_requests": n, "prompt": 16, "output": 1}
    )


SMALL_GEN = {"arrival": "poisson", "rate": 4.0, "num_requests": 60, "prompt": 200, "output": 20, "seed": 3}
