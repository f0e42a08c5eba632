"""StagingRing: a pinned input buffer is rewritten only after its last queued copy has run.

Fake events log what the ring asks of them, in order."""

from __future__ import annotations

import pytest

from engine.staging import StagingRing


class FakeEvent:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")

    def record(self, stream: str) -> None:
        self.log.append(f"record {self.name} on {stream}")


def test_each_reuse_waits_for_the_buffers_last_copy() -> None:
    log: list[str] = []
    ring = StagingRing(["buf0", "buf1"], [FakeEvent("e0", log), FakeEvent("e1", log)])
    got = []
    for _ in range(3):  # three steps queued before the host waits for any (chunks that sample nothing)
        got.append(ring.acquire())
        ring.copied("s")
    assert got == ["buf0", "buf1", "buf0"]
    assert log == [
        "wait e0",
        "record e0 on s",
        "wait e1",
        "record e1 on s",
        "wait e0",  # the third step's build waits for the first step's copy out of buf0
        "record e0 on s",
    ]
    assert ring.num_acquired == 3


def test_off_the_gpu_the_ring_hands_out_its_buffers_without_events() -> None:
    ring = StagingRing([None, None], [None, None])
    assert [ring.acquire() for _ in range(3)] == [None, None, None]
    ring.copied(None)


def test_mismatched_events_are_refused() -> None:
    with pytest.raises(ValueError, match="as many events as buffers"):
        StagingRing(["a", "b"], [None])
