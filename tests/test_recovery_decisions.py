"""The recovery decision as a table: a run and the scheduler's facts in, an action out (a
worker left, an output was lost, workers joined)
(rechunk_p2p.recovery, pure; the cluster tests of test_worker_leaves.py and
test_lost_outputs.py carry the actions out for real)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from rechunk_p2p.planning import make_partials
from rechunk_p2p.recovery import (
    Continue,
    GoOn,
    Restart,
    RunFacts,
    SchedulerRun,
    TransferFacts,
    output_lost,
    worker_left,
    workers_joined,
)
from rechunk_p2p.spec import RunId, RunSpec, ShuffleId, ShuffleSpec, barrier_key

# 2 inputs (one transfer each), 6 outputs: a owns 0-1, b 2-3, c 4-5; d sends pieces only
(_PARTIAL,) = make_partials(((2, 2), (6,)), ((4,), (1,) * 6))
SPEC = ShuffleSpec(ShuffleId("s-0"), _PARTIAL, np.dtype("f8"), "memory", "out")
RUN_SPEC = RunSpec(SPEC, RunId(1), ("a", "b", "c"), ("A", "B", "C"), shift=0)
BARRIER = barrier_key(SPEC.shuffle_id)
NEXT = RunId(7)
ALL = frozenset("abcd")


def _run(**changes: object) -> SchedulerRun:
    run = SchedulerRun(RUN_SPEC, participants={"a", "b", "c", "d"}, owners=RUN_SPEC.owners())
    for name, value in changes.items():
        setattr(run, name, value)
    return run


def _transfer(index: int, on: str | None, cut_for: int | None = 1) -> TransferFacts:
    """Transfer ``index`` finished on ``on`` (``None``: not finished), cut for ``cut_for``."""
    if on is None:
        return TransferFacts(index, done=False)
    key = ("transfer", index)
    return TransferFacts(index, True, (key,), (on,), None if cut_for is None else RunId(cut_for))


def _facts(
    barrier: str | None = "processing",
    ran: tuple[str | None, str | None] = ("a", "b"),
    pending: frozenset[int] = frozenset(range(6)),
    present: frozenset[str] = ALL,
) -> RunFacts:
    transfers = tuple(_transfer(i, on) for i, on in enumerate(ran))
    return RunFacts(barrier, transfers, pending, present)


# --- a worker leaves: (case, run, worker, facts) -> what the run does ----------------------

CASES = [
    # a worker of no run
    ("not in the run", _run(), "e", _facts(), None),
    # a bystander (no outputs) left before the barrier: its transfer runs again
    (
        "bystander, before the barrier",
        _run(),
        "d",
        _facts(ran=("d", "a")),
        GoOn("d", (("transfer", 0), BARRIER), 1),
    ),
    ("bystander, transfers elsewhere", _run(), "d", _facts(barrier="waiting"), GoOn("d", (), 0)),
    ("bystander, after the barrier", _run(), "d", _facts(barrier="memory"), GoOn("d", (), 0)),
    # an owner left where the others are all there: its outputs move
    ("owner, others there", _run(), "c", _facts(ran=("a", "c")), "continue"),
    # an owner left where it cannot continue: the run restarts
    ("owner, another gone", _run(), "c", _facts(present=frozenset("ac")), Restart("worker c left")),
    ("owner, barrier failed", _run(), "c", _facts(barrier="erred"), Restart("worker c left")),
    ("owner, barrier gone", _run(), "c", _facts(barrier=None), Restart("worker c left")),
]


@pytest.mark.parametrize(
    ("run", "worker", "facts", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_worker_left(run, worker, facts, expected):
    action = worker_left(run, worker, facts, NEXT)
    if expected != "continue":
        assert action == expected
        return
    assert isinstance(action, Continue)
    assert action.new.run_id == NEXT and action.new.lineage == (1,)
    assert action.left == "c" and action.moved == {4, 5}
    assert [action.new.worker_for(f) for f in (4, 5)] == ["a", "b"]
    # input 1's transfer ran on c: its pieces may be gone; input 0's were queued by a
    assert action.new.resend_all == {1} and action.full_by == {0: "a"}
    # every transfer runs again (outputs moved), and the barrier
    assert action.release == (("transfer", 0), ("transfer", 1), BARRIER)
    assert action.reruns == 2 and action.carried == {}
    assert action.keep == {"a": [0, 1], "b": [2, 3]} and action.finished == 0


def test_an_owner_leaving_after_the_barrier_sends_nothing_in_full_and_remakes_lost_outputs():
    # the barrier passed (every piece arrived); output 0, assembled on a, is wanted again
    run = _run(delivered=True, assembled={0, 2})
    facts = _facts(barrier="memory", pending=frozenset({0, 1, 4}))
    action = worker_left(run, "c", facts, NEXT)
    assert isinstance(action, Continue)
    assert action.new.resend_all == frozenset() and action.remade == 1
    assert action.moved == {0, 4, 5}  # c's outputs, and 0 assembled again on the next worker
    assert action.new.worker_for(0) == "b"
    assert action.keep == {"a": [1], "b": []} and action.finished == 2  # 2 and 3 are done


def test_a_transfer_cut_for_an_older_run_does_not_count_as_sent_in_full():
    # transfer 0 finished on a, but for run 3, which this run does not carry
    facts = replace(_facts(ran=("a", "a")), transfers=(_transfer(0, "a", 3), _transfer(1, "a")))
    action = worker_left(_run(), "c", facts, NEXT)
    assert isinstance(action, Continue)
    assert action.new.resend_all == {0} and action.full_by == {1: "a"}


def test_an_unfinished_transfer_sends_in_full():
    action = worker_left(_run(), "c", _facts(ran=(None, "a")), NEXT)
    assert isinstance(action, Continue)
    assert action.new.resend_all == {0} and action.reruns == 1
    assert action.release == (("transfer", 1), BARRIER)


def test_a_bystander_that_cut_inputs_in_full_for_an_earlier_run_continues_the_run():
    # run 1 continued as run 2 (c left: its outputs moved); d had sent input 1 in full for
    # run 1, its pieces maybe still queued there: the run that continues sends it in full
    continued = RUN_SPEC.continued_without("c", RunId(2))
    run = _run(run_spec=continued, owners=continued.owners(), full_by={1: "d", 0: "a"})
    action = worker_left(run, "d", _facts(ran=("a", "a")), NEXT)
    assert isinstance(action, Continue)
    assert action.new.lineage == (1, 2) and action.new.resend_all == {1}
    assert action.moved == frozenset() and action.left == "d"
    # no output moved: run 2's transfers count as they are but the one sending in full
    assert action.carried == {RunId(2): frozenset()}
    assert action.release == (("transfer", 1), BARRIER) and action.reruns == 1


def test_a_continuation_updates_the_run_record():
    run = _run(assembled={0, 4})
    action = worker_left(run, "c", _facts(ran=("a", "c"), pending=frozenset({1, 2, 3})), NEXT)
    assert isinstance(action, Continue)
    run.continue_as(action)
    assert run.run_spec is action.new and run.owners == {"a", "b"}
    assert run.assembled == {0}  # 4 moved: assembled again on its new worker
    assert "c" in run.departed and "c" not in run.participants
    assert run.full_by == {0: "a"}


# --- an output assembled before is lost -------------------------------------------------


def test_a_lost_output_is_assembled_again_on_the_next_worker():
    run = _run(assembled={1, 2, 3}, delivered=True)
    facts = _facts(barrier="memory", pending=frozenset({2, 5}))
    action = output_lost(run, 1, "a", "its result went with e", facts, NEXT)
    assert isinstance(action, Continue)
    assert action.moved == {1, 2} and action.remade == 2  # and 2, wanted again too
    assert [action.new.worker_for(f) for f in (1, 2)] == ["b", "c"]
    assert action.why == "Output (0, 1) and 1 more was lost (its result went with e)"
    assert action.left is None and action.release[-1] == BARRIER


@pytest.mark.parametrize(
    ("run", "worker", "facts", "expected"),
    [
        (_run(), "b", _facts(), None),  # output 0 is a's: moved since, its task runs there
        (_run(run_spec=replace(RUN_SPEC, workers=("a",), dataplanes=("A",))), "a", _facts(), "r"),
        (_run(), "a", _facts(present=frozenset("ab")), "r"),  # c is gone
        (_run(), "a", _facts(barrier="erred"), "r"),
    ],
    ids=["moved since", "one worker", "a worker gone", "barrier failed"],
)
def test_a_lost_output_restarts_the_run_where_it_cannot_continue(run, worker, facts, expected):
    action = output_lost(run, 0, worker, "lost", facts, NEXT)
    assert action == (Restart("lost") if expected == "r" else expected)


# --- workers join while the transfers run ----------------------------------------------

JOINED = {"e": "E", "f": "F", "g": "G"}


def test_workers_joining_while_the_transfers_run_take_a_share():
    # transfer 0 finished on a (its pieces queued there), transfer 1 has not run
    facts = _facts(barrier="waiting", ran=("a", None), present=ALL | set(JOINED))
    action = workers_joined(_run(), JOINED, facts, NEXT)
    assert isinstance(action, Continue)
    new = action.new
    assert new.workers == ("a", "b", "c", "e", "f", "g") and new.dataplanes[3:] == ("E", "F", "G")
    # 6 outputs over 6 workers: one each; a, b and c give their second
    assert [new.worker_for(f) for f in range(6)] == ["a", "e", "b", "f", "c", "g"]
    assert action.moved == {1, 3, 5} and action.left is None
    # the finished transfer runs again for the moved outputs; the other sends every piece
    assert new.resend_all == {1} and action.full_by == {0: "a"}
    assert action.release == (("transfer", 0),) and action.reruns == 1


@pytest.mark.parametrize(
    ("run", "facts"),
    [
        (_run(), _facts(barrier="processing", present=ALL | set(JOINED))),  # transfers done
        (_run(), _facts(barrier="memory", present=ALL | set(JOINED))),  # barrier passed
        (_run(), _facts(barrier="waiting", present=ALL | set(JOINED))),  # both transfers done
        (_run(), _facts(barrier="waiting", ran=(None, None))),  # the joined are gone already
        (_run(departed={"e", "f", "g"}), _facts(barrier="waiting", ran=(None, None))),
        (  # the rechunk was restricted to a, b and c
            _run(),
            replace(
                _facts(barrier="waiting", ran=(None, None), present=ALL | set(JOINED)),
                allowed=frozenset("abc"),
            ),
        ),
        (  # a continuation after the barrier passed: its transfers send moved pieces only
            _run(delivered=True),
            _facts(barrier="waiting", ran=(None, None), present=ALL | set(JOINED)),
        ),
        (  # a continuation of a run whose inputs were all sent in full before
            _run(full_by={0: "a", 1: "b"}),
            _facts(barrier="waiting", ran=(None, None), present=ALL | set(JOINED)),
        ),
    ],
    ids=[
        "barrier running",
        "barrier passed",
        "most transfers done",
        "gone",
        "left before",
        "restricted",
        "continued after the barrier",
        "continued, inputs sent",
    ],
)
def test_workers_joining_change_nothing_past_the_transfers_or_when_gone(run, facts):
    assert workers_joined(run, JOINED, facts, NEXT) is None


def test_a_joined_worker_takes_a_share_by_its_memory_limit():
    # e has the memory of a, b and c together: it takes one output of each (by count alone,
    # with 6 outputs over 4 workers, nobody would give one)
    facts = replace(
        _facts(barrier="waiting", ran=(None, None), present=ALL | {"e"}),
        limits={"a": 1, "b": 1, "c": 1, "e": 3},
    )
    action = workers_joined(_run(), {"e": "E"}, facts, NEXT)
    assert isinstance(action, Continue) and action.moved == {1, 3, 5}
    assert {action.new.worker_for(f) for f in (1, 3, 5)} == {"e"}
    assert workers_joined(_run(), {"e": "E"}, replace(facts, limits={}), NEXT) is None
