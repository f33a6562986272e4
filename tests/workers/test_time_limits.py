"""The watchdog of the stages run in the engine's process (``workers.time_limits``):
what it stops, how, and what it says while a stage runs."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from workers.time_limits import Overrun, SampleClock, SampleTimeLimit, limit_for


def test_a_sleeping_stage_in_the_main_thread_is_woken_and_stopped() -> None:
    clock = SampleClock()
    with clock.interruptible(), pytest.raises(SampleTimeLimit):
        with clock.watch("s", "/data/s.obj", "compute", 0.5):
            time.sleep(60)  # a real SIGALRM interrupts the sleep
    assert clock.current() is None


def test_a_busy_stage_in_another_thread_is_stopped() -> None:
    clock = SampleClock()
    outcome: dict[str, Any] = {}

    def stage() -> None:
        try:
            with clock.watch("s", "/data/s.obj", "compute", 0.5):
                while True:  # pure Python: the asynchronous exception lands
                    pass
        except SampleTimeLimit:
            outcome["stopped"] = True

    thread = threading.Thread(target=stage)
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and outcome == {"stopped": True}


def test_a_stage_that_ends_in_time_is_left_alone_and_the_handler_hears_of_overruns() -> None:
    overruns: list[Overrun] = []
    stuck: list[Overrun] = []
    done = threading.Event()

    def overran(overrun: Overrun) -> None:
        overruns.append(overrun)
        done.set()

    clock = SampleClock(on_overrun=overran, on_stuck=stuck.append)
    with clock.watch("quick", "/q.obj", "compute", 30):
        assert clock.current() is not None and clock.current().sample_id == "quick"
    with clock.watch("slow", "/s.obj", "prepare", 0.4):
        assert done.wait(60)  # the handler decides: nothing is raised here
    assert [o.sample_id for o in stuck] == ["slow"] and [o.sample_id for o in overruns] == ["slow"]
    assert overruns[0].reason == (
        "loading (read, parse, prepare()) did not finish within its time limit of 0.4 s"
    )


def test_the_run_option_replaces_the_recipe_limit() -> None:
    class Declared:
        time_limit_s = 7

    assert limit_for(Declared(), None) == 7
    assert limit_for(Declared(), 30) == 30
    assert limit_for(object(), None) == 600
