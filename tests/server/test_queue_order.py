"""Requests waiting for a slot are served in the order they came: a waiter is never overtaken,
neither by another waiter nor by a newcomer arriving as a slot frees."""

import threading
import time

import pytest

from edgevl.server import Gate, HTTPError


def holding_and_waiting(gate, holder, waiter) -> tuple:
    """Threads running ``holder`` (once it holds the only slot) and ``waiter`` (once it waits)."""
    threads = []
    for fn, ready in ((holder, gate.locked), (waiter, lambda: gate.waiting >= 1)):
        threads.append(threading.Thread(target=fn))
        threads[-1].start()
        while not ready():
            time.sleep(0.005)
    return tuple(threads)


def test_waiters_are_served_in_arrival_order():
    gate, order = Gate(max_queue=8, slots=1), []

    def request(i, hold):
        with gate():
            order.append(i)
            time.sleep(hold)

    first = threading.Thread(target=request, args=(0, 1.2))
    first.start()
    while not gate.locked():
        time.sleep(0.005)
    others = []
    for i in range(1, 9):   # they queue 60 ms apart, each waiting through several of the gate's polls
        t = threading.Thread(target=request, args=(i, 0.03))
        t.start()
        others.append(t)
        while gate.waiting < i:
            time.sleep(0.005)
        time.sleep(0.06)
    for t in [first, *others]:
        t.join(30)
    assert order == list(range(9))


def test_a_newcomer_does_not_take_a_freed_slot_ahead_of_a_waiter():
    gate, got = Gate(max_queue=4, slots=1), []
    release = threading.Event()

    def holder():   # lets go of its slot and at once asks again, as a client's next request would
        with gate():
            release.wait(10)
        with gate():
            got.append("newcomer")

    def waiter():
        with gate():
            got.append("waiter")

    h, w = holding_and_waiting(gate, holder, waiter)
    release.set()
    h.join(10)
    w.join(10)
    assert got == ["waiter", "newcomer"]


def test_a_waiter_that_hangs_up_leaves_and_the_queue_goes_on():
    gate, order = Gate(max_queue=1, slots=1), []
    release, hung = threading.Event(), threading.Event()

    def holder():
        with gate():
            release.wait(10)

    def quitter():
        with pytest.raises(ConnectionError):
            with gate(gone=hung.is_set):
                order.append("quitter")

    h, q = holding_and_waiting(gate, holder, quitter)
    with pytest.raises(HTTPError) as e:   # the queue is full
        with gate():
            pass
    assert e.value.status == 429
    hung.set()
    q.join(5)
    assert gate.waiting == 0 and not q.is_alive()
    release.set()
    h.join(5)
    with gate():
        order.append("next")
    assert order == ["next"] and gate.held == 0 and gate.waiting == 0
