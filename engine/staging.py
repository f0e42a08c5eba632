"""Pinned host buffers for each step's host-to-device input copy, used in turn, each rewritten only
once the device has taken its last copy out of it.

A chunked prefill whose chunks sample nothing lets the host queue three or more steps before it
waits for any; a buffer reused by turn alone would then be overwritten while an earlier step's copy
out of it is still queued, and that step would run on the later one's inputs.
"""

from __future__ import annotations

from typing import Any


class StagingRing:
    """`buffers` used in turn; `events[i]` (a CUDA event, or None off the GPU) marks buffer i's last
    queued copy. `acquire()` waits for that copy and gives the buffer; `copied(stream)` records the
    copy just queued out of it."""

    def __init__(self, buffers: list[Any], events: list[Any]) -> None:
        if len(buffers) != len(events) or not buffers:
            raise ValueError("StagingRing: needs as many events as buffers, and at least one buffer")
        self.buffers, self.events = buffers, events
        self.num_acquired = 0

    def acquire(self) -> Any:
        i = self.num_acquired % len(self.buffers)
        self.num_acquired += 1
        event = self.events[i]
        if event is not None:
            event.synchronize()  # returns at once when nothing was recorded, or the copy is done
        return self.buffers[i]

    def copied(self, stream: Any) -> None:
        """Record, on `stream`, the copy just queued out of the buffer `acquire` gave last."""
        event = self.events[(self.num_acquired - 1) % len(self.buffers)]
        if event is not None:
            event.record(stream)
