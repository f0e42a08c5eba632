"""Whether a simulated configuration keeps up with the rate it is offered: offered against served
request rate and a verdict, from a run's summary. Pure; the CLI's summary, `kvplan plan`,
`kvplan capacity` and the dashboard use it, and `Load.falls_behind` is the one rule by which they
count a configuration as not serving its rate."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KEEPS_UP, NEAR_SATURATION, OVERLOADED, NO_LOAD = "keeps up", "near saturation", "overloaded", "n/a"
KEEPS_UP_RATIO = 0.95  # served / offered at or above this: keeps up
OVERLOADED_RATIO = 0.80  # below this: overloaded (in between: near saturation)


@dataclass(frozen=True)
class Load:
    """Offered against served request rate of one simulation, and the verdict."""

    offered_rps: float
    served_rps: float
    verdict: str

    @property
    def ratio(self) -> float:
        return self.served_rps / self.offered_rps if self.offered_rps > 0 else math.nan

    @property
    def keeps_up(self) -> bool:
        return self.verdict == KEEPS_UP

    @property
    def falls_behind(self) -> bool:
        """Serves less than KEEPS_UP_RATIO of the offered rate (near saturation or overloaded): its
        queue grows for as long as the traffic lasts, so latencies over a run that ends understate
        what it would do. A plan, a capacity search and the dashboard never count such a
        configuration as meeting its objectives. Too few requests to tell (`n/a`) is not behind."""
        return self.verdict in (NEAR_SATURATION, OVERLOADED)

    def describe(self) -> str:
        """`overloaded: serves 6.67 of 10.1 req/s offered`."""
        return f"{self.verdict}: serves {self.served_rps:.3g} of {self.offered_rps:.3g} req/s offered"


def load_verdict(summary: Mapping[str, Any], arrival_span_s: float) -> Load:
    """Whether a configuration keeps up with the rate it is offered.

    offered = requests / the span of their arrivals. served = the rate at which the configuration
    took requests in: in a queue that grows because service (rate mu) is slower than arrivals
    (lambda), a request arriving at t waits t (lambda / mu - 1), so the mean wait over a span T is
    T / 2 (lambda / mu - 1), and mu = lambda / (1 + 2 mean wait / T). Requests not finished
    (rejected) do not count as served. A configuration that keeps up waits little, and served ~
    offered. Verdict: `keeps up` (served >= 95 % of offered), `near saturation` (>= 80 %),
    `overloaded`; `n/a` with fewer than two requests or no span."""
    n = int(summary.get("num_requests") or 0)
    if n < 2 or not arrival_span_s > 0:
        return Load(math.nan, math.nan, NO_LOAD)
    offered = n / arrival_span_s
    wait = summary.get("queue_mean_s")
    if wait is None or (isinstance(wait, float) and math.isnan(wait)):
        wait = summary.get("ttft_mean_s")
    wait = 0.0 if wait is None or math.isnan(float(wait)) else max(0.0, float(wait))
    finished = int(summary.get("num_finished", n) or 0)
    served = offered * (finished / n) / (1.0 + 2.0 * wait / arrival_span_s)
    ratio = served / offered
    verdict = (
        KEEPS_UP if ratio >= KEEPS_UP_RATIO else NEAR_SATURATION if ratio >= OVERLOADED_RATIO else OVERLOADED
    )
    return Load(offered, served, verdict)


def run_load(summary: Mapping[str, Any]) -> Load:
    """`load_verdict` of a run over the span of its own arrivals (the summary's `arrival_span_s`)."""
    return load_verdict(summary, float(summary.get("arrival_span_s") or 0.0))
