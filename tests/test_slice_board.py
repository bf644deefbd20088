"""The shared board between a worker's main process and its pool children (GPU time slices)."""

from __future__ import annotations

import multiprocessing
import os
import struct

from celery_prio.tiers import Tier
from celery_prio.worker.slice_board import SliceBoard

R, B, O = Tier.REALTIME, Tier.BATCH, Tier.OFFLINE


def test_a_tier_yields_only_to_its_preemptors():
    board = SliceBoard()
    board.set_preemptors({B: {R}})
    assert board.ask(B, 1.0) == [R]
    assert board.ask(O, 1.0) == []
    assert not board.claim_yield(O, R, 1)  # offline has no preemptor
    assert not board.claim_yield(B, B, 1)  # batch does not yield to batch
    assert board.claim_yield(B, R, 1)
    assert board.yields() == {R: 0, B: 1, O: 0}
    assert board.yielded_for() is R


def test_one_waiting_task_frees_one_slot_until_refilled():
    board = SliceBoard()
    board.set_preemptors({B: {R}, O: {R}})
    assert board.claim_yield(B, R, 1)
    assert not board.claim_yield(O, R, 1)  # the one waiting task already has a slot coming
    assert board.claim_yield(O, R, 2)  # a second waiting task gets a second slot
    board.refilled()
    assert board.yielded_for() is None
    assert board.pending() == (0, None)  # (read without the lock while none is pending)
    assert board.claim_yield(B, R, 1)  # new waiting work after the refill
    assert board.pending() == (1, R)


def test_a_pending_yield_is_seen_whichever_field_a_reader_finds_set():
    board = SliceBoard()
    # A reader racing a claim may find one field written and not the other: it must not take that for none.
    for pending, for_tier in ((1, 0), (0, R.value + 1)):
        board._mem[:16] = struct.pack("=qq", pending, for_tier)  # the board's own layout: native byte order
        assert board.pending() != (0, None)


def test_no_preemptors_no_yield():
    board = SliceBoard()
    board.set_preemptors({B: {R}})
    board.set_preemptors({})
    assert board.ask(B, 2.0) == []
    assert not board.claim_yield(B, R, 5)


def _child(board: SliceBoard, queue) -> None:
    preemptors = board.ask(Tier.OFFLINE, 123.0)
    queue.put((preemptors, board.claim_yield(Tier.OFFLINE, Tier.BATCH, 1)))


def test_a_forked_child_shares_the_board():
    board = SliceBoard()
    board.set_preemptors({O: {R, B}})
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(board, queue))
    child.start()
    assert queue.get(timeout=10) == ([R, B], True)
    child.join(10)
    assert board.yields()[O] == 1
    assert board.yielded_for() is B
    assert board.active_tiers(since=100.0) == [O]


def test_tasks_blocked_in_wait_are_counted_per_tier_and_survive_other_writes():
    board = SliceBoard()
    board.enter_wait(R)
    board.enter_wait(R)
    board.set_preemptors({B: {R}})  # the slice fields of a tier do not overwrite its waiting count
    board.ask(R, 1.0)
    board.leave_wait(R)
    assert board.waiting() == {R: 1, B: 0, O: 0}
    board.leave_wait(B)  # never below zero
    assert board.waiting()[B] == 0


def test_changes_to_the_served_queues_are_counted_where_a_forked_child_reads_them():
    """The main process counts each change to the queues it serves; a pool child lists its sub-queues again when
    the count moved (a per-call realtime task's new sub-queue), and the other fields are left as they were.
    (A bare fork and a pipe: the child starts no thread, which a fork of this many-threaded test process could
    leave waiting on a lock.)"""
    board = SliceBoard()
    board.set_preemptors({B: {R}})
    board.set_held({R: 2})
    assert board.queue_changes() == 0
    board.queues_changed()
    board.queues_changed()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what it reads of the board, then out without running the parent's exit handlers
        try:
            os.write(write, str(board.queue_changes()).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 32) == b"2"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert board.ask(B, 1.0) == [R] and board.held(R) == 2 and board.pending() == (0, None)
