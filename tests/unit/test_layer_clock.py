"""LayerClock: each layer's reads posted (layer 0 on the caller's thread, the rest by its poller)
and waited for on their own."""

from __future__ import annotations

import threading
import time

from kvstore.connector.layerwise import LayerClock


class Transfer:
    def __init__(self, state: str = "pending") -> None:
        self.state = state

    def poll(self) -> str:
        return self.state


def test_layers_end_in_any_order_and_one_failed_read_fails_the_load():
    transfers = [Transfer() for _ in range(3)]
    clock = LayerClock(3, lambda layer: [transfers[layer]], time.perf_counter(), timeout_s=30)
    transfers[2].state = "done"
    assert clock.wait(2) == "done" and clock.state() == "pending"
    transfers[1].state, transfers[0].state = "failed", "done"
    assert (clock.wait(0), clock.wait(1)) == ("done", "failed")
    assert clock.finish() is False and clock.state() == "failed"
    assert all(t is not None and t >= 0 for t in clock.timings()["t_xfer_s"])


def test_a_layer_already_read_is_not_kept_waiting_for_the_poller():
    """Layer 0 was copied on the caller's thread; the poller is still busy posting layer 1 (here:
    blocked). The waiter sees layer 0 ended itself; it does not wait for the poller's next round."""
    posting = threading.Event()

    def post(layer: int) -> list:
        if layer == 1:
            posting.wait(30)
        return [Transfer("done")]

    clock = LayerClock(2, post, time.perf_counter(), timeout_s=2)
    try:
        assert clock.wait(0) == "done" and not posting.is_set()
    finally:
        posting.set()
    assert clock.wait(1) == "done" and clock.finish() is True


def test_a_layer_whose_post_has_not_returned_is_not_taken_for_arrived():
    """The forward waits for layer 1 while the poller is still inside its post (a NIXL submit, or an
    inline copy): the layer has no transfers yet, which must not read as "all of them ended"."""
    posting, entered = threading.Event(), threading.Event()
    transfer = Transfer("pending")

    def post(layer: int) -> list:
        if layer == 1:
            entered.set()
            posting.wait(30)
            return [transfer]
        return [Transfer("done")]

    clock = LayerClock(2, post, time.perf_counter(), timeout_s=0.5)
    try:
        assert entered.wait(30)  # the poller is inside layer 1's post
        assert clock.wait(1) == "pending" and not posting.is_set()  # given up on, never "done"
    finally:
        posting.set()
    assert clock.finish() is False and clock.states[1] == "failed"  # still pending at its deadline


def test_a_layer_post_that_raises_fails_the_layers_left_at_once_and_the_poller_lives_on():
    """Layer 2's post raises (a NIXL submit refused, a copy planned outside the arena): layers 2 and
    3 fail at once, well before the timeout, and layer 1, posted before it, still ends as it does."""
    layer1 = Transfer("pending")

    def post(layer: int) -> list:
        if layer == 2:
            raise RuntimeError("submit refused")
        return [layer1] if layer == 1 else [Transfer("done")]

    timeout_s = 60
    clock = LayerClock(4, post, time.perf_counter(), timeout_s=timeout_s)
    started = time.perf_counter()
    assert clock.wait(3) == "failed" and clock.wait(2) == "failed"
    assert time.perf_counter() - started < timeout_s / 2  # not the whole timeout per layer
    assert clock.wait(0) == "done" and clock.states[1] == "pending"
    layer1.state = "done"
    assert clock.wait(1) == "done"  # still polled
    assert clock.finish() is False and clock.states == ["done", "done", "failed", "failed"]


def test_a_transfer_whose_poll_raises_fails_its_layer_not_the_poller():
    class Broken:
        def poll(self) -> str:
            raise RuntimeError("agent gone")

    clock = LayerClock(3, lambda layer: [Broken()] if layer == 1 else [Transfer("done")], time.perf_counter(),
                       timeout_s=60)
    assert [clock.wait(i) for i in range(3)] == ["done", "failed", "done"]
    assert clock.finish() is False
