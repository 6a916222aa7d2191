"""The hand-off of a script's inner steps to the DiLoCo loop (protocols/steps.py): the script runs on, without a
hand-off, up to the next step the loop acts at, and waits there; a hold takes it back to a step's end."""

import asyncio
import threading

import pytest

from swarmd.protocols.diloco.loop import _next_event
from swarmd.protocols.steps import StepsEnded, UserSteps

pytestmark = [pytest.mark.beside, pytest.mark.timeout(60)]


def _acts_at(step, h, offsets, rounds_done, rounds, waiting, total):
    """The schedule of DilocoLoop._run, stepped one step at a time: does the end of ``step`` send or close?"""
    if step >= total:
        return True
    for p, offset in enumerate(offsets):
        if p not in waiting and rounds_done[p] < rounds and step >= offset + h and (step - offset) % h == 0:
            return True
    return any(step >= close_at for _, close_at in waiting.values())


@pytest.mark.parametrize("h,fragments,overlap", [(10, 1, 0), (10, 2, 0), (12, 3, 4), (5, 4, 2), (1, 1, 0)])
def test_the_next_event_is_the_first_step_the_schedule_acts_at(h, fragments, overlap):
    offsets = [p * h // fragments for p in range(fragments)]
    rounds = 6
    total = rounds * h + max(offsets)
    rounds_done, waiting = [0] * fragments, {}
    for step in range(total):
        expected = next(s for s in range(step + 1, total + 1)
                        if _acts_at(s, h, offsets, rounds_done, rounds, waiting, total))
        assert _next_event(step, total, h, offsets, rounds_done, rounds, waiting) == expected, step
        s = step + 1  # what _run does at the end of the step
        for p in range(fragments):
            if p not in waiting and rounds_done[p] < rounds and s >= offsets[p] + h and (s - offsets[p]) % h == 0:
                waiting[p] = (rounds_done[p], s + overlap)
        for p, (r, close_at) in list(waiting.items()):
            if s >= close_at or s >= total:
                del waiting[p]
                rounds_done[p] += 1


async def test_the_script_runs_to_the_granted_step_and_waits_there():
    steps = UserSteps()
    taken_without_wait = []

    def script():
        assert steps.wait_released(lambda: None, timeout=10)
        for i in range(8):
            steps.report_loss(float(i))
            assert steps.step_taken()
            if steps.taken < steps.granted:
                taken_without_wait.append(i)
            elif i < 7:
                assert steps.wait_released(lambda: None, timeout=10)

    thread = threading.Thread(target=script)
    thread.start()
    steps.grant(5)
    losses = [await steps.next_step() for _ in range(5)]
    assert losses == [0.0, 1.0, 2.0, 3.0, 4.0]
    await asyncio.sleep(0.2)
    assert steps.taken == 5  # it waits at the granted step until the loop grants more
    steps.grant(3)
    assert [await steps.next_step() for _ in range(3)] == [5.0, 6.0, 7.0]
    await asyncio.to_thread(thread.join, 10)
    assert taken_without_wait == [0, 1, 2, 3, 5, 6]  # no hand-off inside a granted stretch
    steps.stop()
    with pytest.raises(StepsEnded):
        await steps.next_step()


async def test_a_hold_takes_the_script_back_to_a_steps_end():
    steps = UserSteps()
    in_step = threading.Event()
    finish = threading.Event()

    def script():
        steps.wait_released(lambda: None, timeout=10)
        while True:
            in_step.set()
            finish.wait(10)  # a step under way
            finish.clear()
            if not steps.step_taken():
                return
            if steps.taken >= steps.granted and not steps.wait_released(lambda: None, timeout=10):
                return

    steps.grant(100)
    thread = threading.Thread(target=script, daemon=True)
    thread.start()
    await asyncio.to_thread(in_step.wait, 10)
    hold = asyncio.ensure_future(steps.hold())
    await asyncio.sleep(0.1)
    assert not hold.done()  # the step under way has not ended
    finish.set()
    await asyncio.wait_for(hold, 10)
    assert steps.taken == steps.granted == 1  # held at that step's end, none beyond
    steps.stop()
    finish.set()
    await asyncio.to_thread(thread.join, 10)
