"""A termination notice in the shared loop (one process, no Ray): the step it is seen at is checkpointed when the save
fits before the deadline, and then the rank waits for the restart; a save that cannot fit is skipped and training goes
on. The notice itself is the fault here (Ray's drain, stood in for by `poll`); the loop and the saves are real."""

from __future__ import annotations

import time

import pytest
import torch

from tests.train.test_loop import OPTIM, PLAN, ListSource, Recorder, packed_rows, tiny_llama
from train.checkpoint import TrainerState
from train.loop import train_loop
from train.notice import Notice, NoticeSaver, NotDrained, SaveTimes, decide
from train.optimizer import build_optimizer


def test_a_save_fits_when_its_measured_time_and_the_margin_are_left_before_the_deadline():
    times = SaveTimes(first_guess_s=10.0)
    assert times.estimate() == 10.0  # nothing measured yet: the configured guess
    for seconds in (1.0, 4.0, 2.0, 1.5):
        times.add(seconds)
    assert times.recent == [4.0, 2.0, 1.5] and times.estimate() == 4.0  # the longest of the last 3
    notice = Notice(deadline_s=1000.0)
    assert decide(notice, now=993.0, seen_at=990.0, save_s=4.0, margin_s=3.0, grace_s=30.0).fits  # 7 s left, 7 needed
    late = decide(notice, now=993.5, seen_at=990.0, save_s=4.0, margin_s=3.0, grace_s=30.0)
    assert not late.fits and (late.left_s, late.needed_s) == (6.5, 7.0)
    # No deadline reported: the configured grace from when the notice was seen.
    assert decide(Notice(None), now=1010.0, seen_at=1000.0, save_s=4.0, margin_s=3.0, grace_s=30.0).left_s == 20.0


class Restarted(Exception):
    """What Ray Train does to a rank that waits after the notice's save: it kills the worker group."""


def notice_at(step: int, deadline_in_s: float | None):
    """A poll that reports a notice from the boundary of `step` on (the loop polls once per step)."""
    calls, notices = [], []

    def poll():
        calls.append(1)
        if len(calls) < step:
            return None
        if not notices:  # Ray reports the same notice at every later boundary
            notices.append(Notice(deadline_s=None if deadline_in_s is None else time.time() + deadline_in_s,
                                  nodes=("n1",), ranks=(1,)))
        return notices[0]
    return poll


def run_with_notice(saver_args: dict, poll) -> tuple[Recorder, list, list[str], int]:
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer, scheduler = build_optimizer(model, OPTIM, PLAN.total_steps)
    hooks, reports, lines, waited = Recorder(), [], [], []

    def sleep(seconds):
        waited.append(seconds)
        raise Restarted

    state = TrainerState()
    saver = NoticeSaver(poll, report=lambda *a: reports.append(a), sleep=sleep, log=lines.append, **saver_args)
    try:
        train_loop(model, optimizer, scheduler, ListSource(packed_rows(12, seed=1), batch=2), PLAN, state, hooks,
                   torch.device("cpu"), notice=saver)
    except Restarted:
        pass
    return hooks, reports, lines, state.step


def test_the_step_a_notice_is_seen_at_is_checkpointed_and_the_rank_then_waits_for_the_restart():
    # Checkpoints every 2 steps; the notice arrives at step 5's boundary with 60 s left and saves measured at 2 s.
    args = dict(times=SaveTimes([2.0]), grace_s=30.0, margin_s=3.0)
    hooks, reports, lines, last = run_with_notice(args, notice_at(5, 60.0))
    assert hooks.checkpoints == [2, 4, 5]  # the notice's save, not the last periodic one
    assert last == 5 and max(hooks.losses) == 5  # no step after it: the rank waited until Ray restarted the group
    (step, notice, decision, saved), = reports
    assert (step, saved, notice.nodes) == (5, True, ("n1",)) and decision.needed_s == 5.0
    assert 55 < decision.left_s <= 60
    assert "saving now" in lines[0] and "waiting for the node to go" in lines[1]


def test_a_save_that_cannot_fit_before_the_deadline_is_skipped_and_training_goes_on():
    # 4 s left; the last saves took up to 6 s: no checkpoint at the notice, the periodic ones and the end go on.
    args = dict(times=SaveTimes([1.0, 6.0]), grace_s=30.0, margin_s=1.0)
    hooks, reports, lines, last = run_with_notice(args, notice_at(5, 4.0))
    assert hooks.checkpoints == [2, 4, 6, 8, 10] and last == PLAN.total_steps
    (step, _, decision, saved), = reports  # judged once, not again at every later step
    assert (step, saved, decision.needed_s) == (5, False, 7.0)
    assert "too little for a checkpoint" in lines[0] and "not saving" in lines[0]


def test_every_rank_must_find_that_the_save_fits():
    """`agree` is the collective (all ranks' minimum): one rank short of time means no rank saves."""
    args = dict(times=SaveTimes([1.0]), grace_s=30.0, margin_s=1.0, agree=lambda fits: False)
    hooks, reports, _, last = run_with_notice(args, notice_at(5, 60.0))
    assert hooks.checkpoints == [2, 4, 6, 8, 10] and reports[0][3] is False and last == PLAN.total_steps


def test_a_notice_at_a_periodic_checkpoint_is_not_saved_twice_and_one_without_deadline_gets_the_grace():
    args = dict(times=SaveTimes(first_guess_s=5.0), grace_s=30.0, margin_s=3.0)
    hooks, reports, _, last = run_with_notice(args, notice_at(4, None))
    assert hooks.checkpoints == [2, 4] and last == 4
    decision = reports[0][2]
    assert decision.fits and 29 < decision.left_s <= 30 and decision.needed_s == 8.0


def test_a_rank_that_saved_gives_up_once_the_deadline_is_long_past():
    """Ray Train restarts the group at the deadline; should it not, the rank fails (and is retried) after the slack."""
    clock = [1000.0]
    saver = NoticeSaver(lambda: Notice(deadline_s=1010.0), SaveTimes([1.0]), grace_s=30.0, margin_s=1.0,
                        clock=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s), log=lambda line: None)
    state = TrainerState(step=7)
    assert saver.save_now(state) and not saver.save_now(state)  # the same notice is judged once
    with pytest.raises(NotDrained, match="step 7: saved on a termination notice"):
        saver.saved(state)
    assert clock[0] >= 1070.0
