"""Routers that spread arriving requests over a cluster's replicas.

`round_robin`, `least_outstanding` (fewest prompt + output tokens of unfinished requests) and
`prefix_aware` (longest prefix already cached on a replica, then least outstanding). They read replica
state; they never schedule.
"""

from __future__ import annotations

from engine.core.sequence import Sequence
from engine.sampling_params import SamplingParams


class Router:
    reads_prompt = False  # whether `choose` looks at the prompt's tokens (else its length will do)

    def __init__(self, replicas: list) -> None:
        self.replicas = replicas

    def choose(self, prompt: list[int]):
        raise NotImplementedError


class RoundRobinRouter(Router):
    def __init__(self, replicas: list) -> None:
        super().__init__(replicas)
        self._next = 0

    def choose(self, prompt: list[int]):
        replica = self.replicas[self._next]
        self._next = (self._next + 1) % len(self.replicas)
        return replica


class LeastOutstandingRouter(Router):
    def choose(self, prompt: list[int]):
        """The replica with the fewest outstanding tokens, of those the lowest index."""
        replicas = self.replicas
        best = replicas[0]
        fewest = best.outstanding_tokens
        for replica in replicas:
            tokens = replica.outstanding_tokens
            if tokens < fewest or (tokens == fewest and replica.index < best.index):
                best, fewest = replica, tokens
        return best


def least_outstanding_lead(outstanding: int, index: int, others: list[int]) -> int:
    """Tokens the other replicas must be sent before `LeastOutstandingRouter` can choose replica
    `index`, which holds `outstanding` tokens and sends none away meanwhile: `others` bound each
    replica's outstanding tokens from above (by index, `index`'s own entry ignored; a replica's
    count only grows by what it is sent). It is chosen only when every other one holds more, or as
    many from a higher index."""
    return least_outstanding_needs(outstanding, index, others)[0]


def least_outstanding_needs(outstanding: int, index: int, others: list[int]) -> tuple[int, int]:
    """(`least_outstanding_lead`, how many other replicas must be sent a request first): each one
    the router would choose before `index` now must be sent at least one, and one arrival goes to
    one replica, so at least that many arrivals go elsewhere before `index` can be chosen."""
    lead = count = 0
    for o in others[:index]:  # a lower index is chosen first at a tie
        if o <= outstanding:
            lead += outstanding + 1 - o
            count += 1
    for o in others[index + 1 :]:
        if o < outstanding:
            lead += outstanding - o
            count += 1
    return lead, count


class PrefixAwareRouter(Router):
    reads_prompt = True
    _PARAMS = SamplingParams(max_tokens=1)

    def choose(self, prompt: list[int]):
        probe = Sequence(-1, prompt, self._PARAMS)  # shares its hash memo across replicas

        def score(r):
            return (-len(r.block_manager.lookup_prefix(probe)), r.outstanding_tokens, r.index)

        return min(self.replicas, key=score)


ROUTER_CLASSES = {
    "round_robin": RoundRobinRouter,
    "least_outstanding": LeastOutstandingRouter,
    "prefix_aware": PrefixAwareRouter,
}


def make_router(name: str, replicas: list) -> Router:
    if name not in ROUTER_CLASSES:
        raise ValueError(f"router: {name!r} is not one of {sorted(ROUTER_CLASSES)}")
    if len(replicas) == 1:
        return RoundRobinRouter(replicas)
    return ROUTER_CLASSES[name](replicas)
