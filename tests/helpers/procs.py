"""The one way tests start processes: ``spcache`` commands (and any other program) run to
completion, started in the background, waited on, and the service on a socket bound first.

- :func:`run` / :func:`run_spcache`: to completion within a timeout, output captured
  (a :class:`subprocess.CompletedProcess` with text ``stdout`` and ``stderr``). On timeout
  the whole process tree is killed and the test fails with the output so far.
- :func:`start` / :func:`start_spcache`: in the background, as a :class:`Proc` whose
  stdout and stderr are read line by line as they come (:meth:`Proc.wait_line`). Each
  starts in its own session; leaving its ``with`` block, :meth:`Proc.stop` or the
  ``reap_processes`` fixture of ``tests/conftest.py`` (after every test) kills what is
  left of its process tree.
- :func:`wait_for`, :func:`wait_file`, :func:`wait_http`: an event within a generous
  bound, failing at once (with the output) if the process it depends on has exited.
- :func:`serve`: ``spcache serve`` on a loopback socket this process bound first and
  handed over (``--fd``), so no port is looked up free and bound later by someone else.

Timeouts here are bounds on waiting for an event, never an assertion on speed: the suite
runs on a loaded 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import psutil

from tests.conftest import REPO_ROOT

__all__ = [
    "Proc",
    "Server",
    "bound_socket",
    "child_env",
    "environment",
    "has_descendant",
    "ignores",
    "kill_leftovers",
    "kill_tree",
    "live",
    "popen",
    "port_is_free",
    "refused_port",
    "run",
    "serve",
    "run_spcache",
    "spcache_argv",
    "start",
    "start_spcache",
    "still_running",
    "tree",
    "wait_file",
    "wait_for",
    "wait_gone",
    "wait_http",
]

T = TypeVar("T")

#: how long a command may run to completion before the test fails (a bound, not a goal)
RUN_TIMEOUT = 600.0
#: how long an awaited event may take on a loaded machine
EVENT_TIMEOUT = 120.0


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """This process's environment (which the processes it starts inherit) with
    ``values`` set inside the block, and as it was after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def spcache_argv(*args: str | os.PathLike[str]) -> list[str]:
    """``spcache ARGS`` as this interpreter runs it (the venv the tests run in)."""
    return [sys.executable, "-m", "spcache", *map(str, args)]


def child_env(
    env: Mapping[str, str | None] | None = None, *, inherit: bool = True
) -> dict[str, str]:
    """This process's environment (``inherit=False``: an empty one) with ``env`` laid
    over it (a ``None`` value removes the variable)."""
    out = dict(os.environ) if inherit else {}
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------- trees


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants now alive."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def ignores(pid: int, signum: int) -> bool:
    """Whether process ``pid`` ignores ``signum`` (Linux: its ``SigIgn`` mask; False where
    that cannot be read)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(
        (line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), "0"
    )
    return bool(int(mask, 16) >> (signum - 1) & 1)


def kill_tree(procs: Sequence[psutil.Process]) -> None:
    """SIGKILL each of ``procs`` still there (a tree taken with :func:`tree`)."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            proc.kill()


def _kill_session(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s tree: its session's process group is frozen first (SIGSTOP: it
    makes no progress from this call on), then its descendants found now (those that
    left its session too) and the group are killed."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGSTOP)
    kill_tree(tree(proc.pid))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


# --------------------------------------------------------------------------- to completion


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    cwd: Path | str = REPO_ROOT,
    env: Mapping[str, str | None] | None = None,
    inherit_env: bool = True,
    input: str | None = None,
    pass_fds: Sequence[int] = (),
    timeout: float = RUN_TIMEOUT,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to completion and capture its output (text). Past ``timeout`` its
    process tree is killed and the test fails showing what it printed. The child's
    environment is this one with ``env`` over it (``inherit_env=False``: ``env`` only)."""
    proc = subprocess.Popen(
        [str(a) for a in argv],
        cwd=cwd,
        env=child_env(env, inherit=inherit_env),
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        pass_fds=tuple(pass_fds),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, err = proc.communicate()
        raise AssertionError(
            f"{_show(argv)} did not finish within {timeout:.0f} s\n"
            f"--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
        ) from None
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C on pytest): leave nothing behind
            _kill_session(proc)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_spcache(*args: str | os.PathLike[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``spcache ARGS`` to completion (see :func:`run` for the keywords)."""
    return run(spcache_argv(*args), **kwargs)


def _show(argv: Sequence[Any]) -> str:
    shown = [str(a) for a in argv]
    if shown[:3] == [sys.executable, "-m", "spcache"]:
        shown = ["spcache", *shown[3:]]
    return " ".join(shown)[:300]


# --------------------------------------------------------------------------- in the background

_LIVE: list[Proc] = []  # started and not yet reaped: what the clean-up looks at


class Proc:
    """A process started in the background, its output read line by line.

    ``stdout`` and ``stderr`` lines are kept apart (:attr:`out_lines`,
    :attr:`err_lines`) and together in arrival order (:attr:`lines`); a ``log`` file, if
    given, receives both as they come.
    """

    def __init__(
        self,
        argv: Sequence[str | os.PathLike[str]],
        *,
        cwd: Path | str = REPO_ROOT,
        env: Mapping[str, str | None] | None = None,
        inherit_env: bool = True,
        stdin: bool = False,
        pass_fds: Sequence[int] = (),
        log: Path | None = None,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.lines: list[str] = []
        self.out_lines: list[str] = []
        self.err_lines: list[str] = []
        self._changed = threading.Condition()
        self._log = open(log, "a", encoding="utf-8") if log is not None else None  # noqa: SIM115
        self.popen = subprocess.Popen(
            self.argv,
            cwd=cwd,
            env=child_env(env, inherit=inherit_env),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            errors="replace",
            pass_fds=tuple(pass_fds),
            start_new_session=True,
        )
        self._readers = [
            threading.Thread(target=self._pump, args=(pipe, kept), daemon=True)
            for pipe, kept in (
                (self.popen.stdout, self.out_lines),
                (self.popen.stderr, self.err_lines),
            )
        ]
        for reader in self._readers:
            reader.start()
        _LIVE.append(self)

    # -- what it printed

    def _pump(self, pipe: IO[str] | None, kept: list[str]) -> None:
        assert pipe is not None
        for raw in pipe:
            line = raw.rstrip("\n")
            with self._changed:
                kept.append(line)
                self.lines.append(line)
                if self._log is not None:
                    self._log.write(raw if raw.endswith("\n") else raw + "\n")
                    self._log.flush()
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def poll(self) -> int | None:
        """Its exit status, or None while it runs (as :meth:`subprocess.Popen.poll`)."""
        return self.popen.poll()

    def stdout(self) -> str:
        with self._changed:
            return "".join(line + "\n" for line in self.out_lines)

    def stderr(self) -> str:
        with self._changed:
            return "".join(line + "\n" for line in self.err_lines)

    def output(self) -> str:
        """stdout and stderr so far, interleaved as they arrived."""
        with self._changed:
            return "".join(line + "\n" for line in self.lines)

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited with {self.popen.returncode}"
        return f"{_show(self.argv)} ({state}); its output:\n{self.output()[-4000:]}"

    # -- events

    def wait_line(
        self,
        pattern: str | re.Pattern[str],
        timeout: float = EVENT_TIMEOUT,
        *,
        stream: str = "any",
        start: int = 0,
    ) -> re.Match[str]:
        """The first line (of ``stream``: "any", "stdout" or "stderr"; from line
        ``start`` of it on) that ``pattern`` matches (``re.search``). Fails when the
        process exits or ``timeout`` passes without one."""
        return self.next_line(pattern, timeout, stream=stream, start=start)[1]

    def next_line(
        self,
        pattern: str | re.Pattern[str],
        timeout: float = EVENT_TIMEOUT,
        *,
        stream: str = "any",
        start: int = 0,
    ) -> tuple[int, re.Match[str]]:
        """As :meth:`wait_line`, with the matching line's index in ``stream``."""
        regex = re.compile(pattern)
        kept = {"any": self.lines, "stdout": self.out_lines, "stderr": self.err_lines}[stream]
        deadline = time.monotonic() + timeout
        seen = start
        with self._changed:
            while True:
                for index in range(seen, len(kept)):
                    match = regex.search(kept[index])
                    if match:
                        return index, match
                seen = max(seen, len(kept))
                if not any(r.is_alive() for r in self._readers):  # both pipes closed
                    raise AssertionError(f"no line matching {regex.pattern!r}: {self.describe()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"no line matching {regex.pattern!r} within {timeout:.0f} s: "
                        f"{self.describe()}"
                    )
                self._changed.wait(min(left, 1.0))

    def send(self, line: str) -> None:
        """Write one line to its stdin (started with ``stdin=True``)."""
        assert self.popen.stdin is not None, "started without stdin=True"
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the process itself (not its children)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def wait(self, timeout: float = EVENT_TIMEOUT) -> int:
        """Its exit status once it exits by itself; fails (and kills its tree) past
        ``timeout``."""
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"did not exit within {timeout:.0f} s: {self.describe()}"
            ) from None
        self._reap()
        return code

    def stop(self, signum: int = signal.SIGTERM, timeout: float = EVENT_TIMEOUT) -> int:
        """Send ``signum`` and wait for the exit status; past ``timeout`` the tree is
        killed and the test fails. What the process left behind is killed either way."""
        self.send_signal(signum)
        return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the whole tree now (clean-up; a test that kills on purpose picks its
        own signal with :meth:`send_signal`)."""
        _kill_session(self.popen)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(30)
        self._reap()

    def _reap(self) -> None:
        # descendants that outlived it (in its session) go too: a test leaves nothing
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for reader in self._readers:
            reader.join(10)
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if pipe is not None and not pipe.closed:
                with contextlib.suppress(BrokenPipeError, OSError):
                    pipe.close()
        if self._log is not None and not self._log.closed:
            self._log.close()
        with contextlib.suppress(ValueError):
            _LIVE.remove(self)

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.alive():
            self.kill()
        else:
            self._reap()


def start(argv: Sequence[str | os.PathLike[str]], **kwargs: Any) -> Proc:
    """``argv`` in the background (see :class:`Proc` for the keywords)."""
    return Proc(argv, **kwargs)


def start_spcache(*args: str | os.PathLike[str], **kwargs: Any) -> Proc:
    """``spcache ARGS`` in the background."""
    return Proc(spcache_argv(*args), **kwargs)


_BARE: list[subprocess.Popen[Any]] = []  # started by popen(): reaped the same way


def popen(
    argv: Sequence[str | os.PathLike[str]], *, cwd: Path | str = REPO_ROOT, **kwargs: Any
) -> subprocess.Popen[Any]:
    """``argv`` as a bare :class:`subprocess.Popen` (keywords passed on), for a test that
    sets up the child's stdio itself (a terminal, a pipe it closes on purpose). It
    starts in its own session, and what is left of its tree is killed after the test as
    for :func:`start`."""
    kwargs.setdefault("start_new_session", True)
    proc = subprocess.Popen([str(a) for a in argv], cwd=cwd, **kwargs)
    _BARE.append(proc)
    return proc


def live() -> list[object]:
    """The processes started here and not reaped yet (:class:`Proc` and bare ones)."""
    return [*_LIVE, *_BARE]


def kill_leftovers(keep: Sequence[object] = ()) -> list[str]:
    """Kill every process started here and not reaped yet (with its tree), but those in
    ``keep``; returns what was killed, described. ``tests/conftest.py`` calls it after
    each test (keeping what wider-scoped fixtures started) and at the end of the run."""
    left = []
    for proc in list(_LIVE):
        if any(proc is kept for kept in keep):
            continue
        if proc.alive():
            left.append(_show(proc.argv))
        proc.kill()
    for bare in list(_BARE):
        if any(bare is kept for kept in keep):
            continue
        if bare.poll() is None:
            left.append(_show(bare.args))
            _kill_session(bare)
            with contextlib.suppress(subprocess.TimeoutExpired):
                bare.wait(30)
        else:  # its tree may outlive it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(bare.pid, signal.SIGKILL)
        _BARE.remove(bare)
    return left


# --------------------------------------------------------------------------- events


def wait_for(
    predicate: Callable[[], T],
    timeout: float = EVENT_TIMEOUT,
    what: str = "the condition",
    *,
    proc: Proc | None = None,
    interval: float = 0.05,
) -> T:
    """``predicate()``'s first truthy value, asked until ``timeout`` passes; fails at
    once when ``proc`` (what should bring it about) has exited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and not proc.alive():
            value = predicate()  # it may have made it true just before exiting
            if value:
                return value
            raise AssertionError(f"waiting for {what}: {proc.describe()}")
        if time.monotonic() > deadline:
            extra = f"; {proc.describe()}" if proc is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{extra}")
        time.sleep(interval)


def wait_file(path: Path, timeout: float = EVENT_TIMEOUT, *, proc: Proc | None = None) -> Path:
    """``path`` once it exists."""
    wait_for(path.exists, timeout, f"{path} to exist", proc=proc)
    return path


def wait_http(
    url: str,
    timeout: float = EVENT_TIMEOUT,
    *,
    proc: Proc | None = None,
    status: int = 200,
    verify: Any = True,
) -> Any:
    """The first answer to ``GET url`` with ``status`` (connection errors and other
    statuses are waited out)."""
    import httpx

    def answered() -> httpx.Response | None:
        try:
            response = httpx.get(url, timeout=5, verify=verify)
        except httpx.TransportError:
            return None
        return response if response.status_code == status else None

    return wait_for(answered, timeout, f"GET {url} -> {status}", proc=proc, interval=0.1)


# --------------------------------------------------------------------------- the service


def bound_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to ``host`` on a port the system picked, listening; hand it to
    a server (``spcache serve --fd``, uvicorn's ``sockets=``) and nothing can take the
    port in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


@contextlib.contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``host`` held bound and not listening while the block runs: connecting
    to it is refused, and nothing else can take it meanwhile."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        yield sock.getsockname()[1]


@dataclass
class Server:
    """A live ``spcache serve``: its URL and its process."""

    url: str
    proc: Proc
    port: int

    def stop(self, signum: int = signal.SIGTERM, timeout: float = EVENT_TIMEOUT) -> int:
        """Stop it as a user would (SIGTERM) and return its exit status."""
        try:
            return self.proc.stop(signum, timeout)
        finally:
            self.close()

    def close(self) -> None:
        """Kill what is left of it (clean-up)."""
        if self.proc.alive():
            self.proc.kill()
        else:
            self.proc._reap()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    *args: str | os.PathLike[str],
    host: str = "127.0.0.1",
    ready: str | None = "/healthz",
    timeout: float = EVENT_TIMEOUT,
    verify: Any = True,
    **kwargs: Any,
) -> Server:
    """``spcache serve ARGS --fd N`` on a socket bound here first, answering ``ready``
    (None: not waited for). The URL is https when ARGS name a TLS certificate.
    Keywords as :func:`start` (``env``, ``cwd``, ``log``)."""
    sock = bound_socket(host)
    port = sock.getsockname()[1]
    scheme = "https" if "--tls-certfile" in map(str, args) else "http"
    reach = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # a wildcard: via loopback
    shown = f"[{reach}]" if ":" in reach else reach
    url = f"{scheme}://{shown}:{port}"
    with sock:  # the child holds its own copy: once it is gone, the port is closed
        proc = start_spcache(
            "serve", *args, "--fd", str(sock.fileno()), pass_fds=(sock.fileno(),), **kwargs
        )
    server = Server(url, proc, port)
    if ready is not None:
        try:
            wait_http(url + ready, timeout, proc=proc, verify=verify)
        except BaseException:
            server.close()
            raise
    return server


# --------------------------------------------------------------------------- after a stop


def has_descendant(pid: int, *words: str) -> bool:
    """A descendant of ``pid`` whose command line holds every one of ``words``."""
    for proc in tree(pid)[1:]:
        try:
            cmdline = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if all(word in cmdline for word in words):
            return True
    return False


def still_running(procs: Sequence[psutil.Process]) -> list[str]:
    """Those of ``procs`` still running (not zombies), described."""
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


def wait_gone(procs: Sequence[psutil.Process], timeout: float = EVENT_TIMEOUT) -> list[str]:
    """Wait up to ``timeout`` for every one of ``procs`` to end; returns those left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not still_running(procs):
            return []
        time.sleep(0.1)
    return still_running(procs)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on (or holds) ``host:port`` now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
