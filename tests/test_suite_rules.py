"""Rules the test suite keeps about itself.

* No test asserts a duration against the clock. The suite runs on a loaded, shared
  machine, where "it took 16.9 s, more than 11" says nothing about the code: a test waits
  for an event within a generous bound (``tests.helpers.procs.wait_for``, a timeout on
  the call), and how fast things are is measured in ``bench/`` and recorded in
  ``docs/BENCHMARKS.md``. The check reads each test module's syntax tree: an ``assert``
  may not compare a clock difference (``time.monotonic() - t0``, ``perf_counter``,
  ``time.time``), directly or through a name that was given one.
* The suite passes with a user's own recipe plugin installed beside spcache: a test names
  the recipes it relies on and never assumes they are all there is
  (``tests/helpers/recipes.py``). The check runs the tests that list or count recipes
  with a foreign recipe registered (``SPCACHE_RECIPES``, as a plugin that is not
  installed is registered), one whose name sorts before the built-ins.
* Ctrl-C reaches the processes the suite starts as it would from a terminal, however
  the suite itself was started. A script that runs it in the background (``pytest ... &``)
  starts it with SIGINT ignored, and every child inherited the ignore: a ``python -``
  running ``spcache.precompute`` that a test interrupted went on to the end and exited 0.
  ``tests/conftest.py`` gives the run Python's handler back; the check starts the suite
  as such a script does and interrupts a child. The same for a terminal's hang-up
  (SIGHUP) in a suite started with ``nohup``.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT
from tests.helpers.procs import popen, run

TESTS = REPO_ROOT / "tests"
CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}


def _is_clock_call(node: ast.AST) -> bool:
    """``time.monotonic()`` and the like (also imported bare: ``monotonic()``)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if isinstance(func, ast.Attribute) and not (
        isinstance(func.value, ast.Name) and func.value.id == "time"
    ):
        return False
    return name in CLOCKS


def _has_clock_difference(node: ast.AST) -> bool:
    return any(
        isinstance(sub, ast.BinOp)
        and isinstance(sub.op, ast.Sub)
        and (_is_clock_call(sub.left) or _is_clock_call(sub.right))
        for sub in ast.walk(node)
    )


def _target_names(target: ast.AST) -> set[str]:
    """The variable a value lands in: ``x``, ``x[k]``, ``x.attr`` all name ``x``."""
    while isinstance(target, ast.Subscript | ast.Attribute):
        target = target.value
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Tuple | ast.List):
        return set().union(*(_target_names(t) for t in target.elts))
    return set()


def _duration_names(tree: ast.AST) -> set[str]:
    """Names given a clock difference: ``x = clock() - t0``, ``x[k] = ...``,
    ``x.append(clock() - t0)``, ``x = max(x, clock() - t0)``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and node.value:
            if _has_clock_difference(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names |= _target_names(target)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "add", "extend")
            and any(_has_clock_difference(arg) for arg in node.args)
        ):
            names |= _target_names(node.func.value)
    return names


def timed_asserts(source: str, filename: str = "<test>") -> list[str]:
    """``file:line`` of each assert that compares a duration measured by the clock."""
    tree = ast.parse(source, filename)
    durations = _duration_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            operands = [compare.left, *compare.comparators]
            if not any(isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in compare.ops):
                continue
            names = {n.id for o in operands for n in ast.walk(o) if isinstance(n, ast.Name)}
            if any(_has_clock_difference(o) for o in operands) or names & durations:
                found.append(f"{filename}:{node.lineno}")
                break
    return found


def test_no_test_asserts_a_duration_against_the_clock() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += timed_asserts(path.read_text(), str(path.relative_to(REPO_ROOT)))
    assert not found, (
        "asserted durations (wait for an event with a generous bound instead; speed "
        "goes to bench/):\n" + "\n".join(found)
    )


def test_the_duration_check_finds_what_it_must() -> None:
    timed = """
import time
def test_a():
    start = time.monotonic()
    work()
    took = time.monotonic() - start
    assert took < 1.5
def test_b():
    t0 = time.perf_counter()
    assert time.perf_counter() - t0 < 5
def test_c(exits):
    exits.append(time.monotonic() - killed)
    assert max(exits) < LIMIT
def test_d(seconds):
    seconds["x"] = time.perf_counter() - t0
    assert seconds["x"] < 2 * seconds["y"]
"""
    assert timed_asserts(timed) == ["<test>:7", "<test>:10", "<test>:13", "<test>:16"]
    waits = """
import time
def test_e():
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, "timed out waiting"
    took = time.monotonic() - deadline
    report({"took": took})
    assert len(items) < 5
"""
    assert timed_asserts(waits) == []


#: the tests that list, count or name the installed recipes
RECIPE_LISTING_TESTS = [
    "tests/workers/test_recipes.py",
    "tests/spcache/test_dispatch.py",
    "tests/service/test_warmup.py",
    "tests/service/test_records.py",
    "tests/faults/test_record_bound.py",
]


@pytest.mark.slow
def test_recipe_listing_tests_pass_with_a_foreign_recipe_registered() -> None:
    out = run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
        + RECIPE_LISTING_TESTS,
        env={"SPCACHE_RECIPES": "tests.workers.plugin_recipes:Probe"},  # "probe" < "spc"
    )
    assert out.returncode == 0, out.stdout[-4000:]
    assert " passed" in out.stdout.strip().splitlines()[-1]


#: ``ARGV... &`` as a script runs a command in the background, waited for: a
#: non-interactive shell starts it with SIGINT (and SIGQUIT) ignored
IN_THE_BACKGROUND = ["bash", "-c", '"$@" & wait $!', "bash"]
#: a script that says it is ready, then waits to be interrupted
WAITING = "import time\nprint('ready', flush=True)\ntime.sleep(600)\n"
IGNORES_SIGINT = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"


def _signal_ends_a_child(signum: int) -> None:
    """A ``python -`` child that waits, sent ``signum`` to its process group, ends by it."""
    proc = popen(
        [sys.executable, "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(WAITING)
    proc.stdin.close()
    assert proc.stdout.readline().strip() == "ready"
    os.killpg(proc.pid, signum)
    with proc.stdout:
        assert proc.wait(timeout=120) == -signum


def _passes_in_a_suite_started_by(launcher: list[str], test: Any) -> None:
    """``test`` of this file passes in a run of the suite that ``launcher`` starts."""
    name = Path(__file__).relative_to(REPO_ROOT).as_posix() + "::" + test.__name__
    out = run([*launcher, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name])
    assert out.returncode == 0, out.stdout[-4000:]
    assert " 1 passed" in " " + out.stdout.strip().splitlines()[-1]


def test_ctrl_c_to_a_child_ends_it_with_keyboard_interrupt() -> None:
    """A ``python -`` child sent SIGINT to its process group (a terminal's Ctrl-C) ends
    by it: Python's default handling, as a user's script has."""
    _signal_ends_a_child(signal.SIGINT)


def test_ctrl_c_reaches_the_children_of_a_suite_started_in_the_background() -> None:
    """The check above, in a run of the suite that a script started in the background."""
    ignored = run([*IN_THE_BACKGROUND, sys.executable, "-c", IGNORES_SIGINT])
    assert ignored.stdout.split() == ["True"], ignored  # as the run starts
    _passes_in_a_suite_started_by(
        IN_THE_BACKGROUND, test_ctrl_c_to_a_child_ends_it_with_keyboard_interrupt
    )


def test_a_hang_up_to_a_child_ends_it() -> None:
    """A ``python -`` child sent SIGHUP (its terminal closed) ends by it, as a user's
    command started from a terminal does."""
    _signal_ends_a_child(signal.SIGHUP)


def test_a_hang_up_reaches_the_children_of_a_suite_started_under_nohup() -> None:
    """The check above, in a run of the suite started with ``nohup`` (SIGHUP ignored,
    which every child would inherit)."""
    _passes_in_a_suite_started_by(["nohup"], test_a_hang_up_to_a_child_ends_it)
