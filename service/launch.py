"""Starting the service: what would stop it is refused first, then uvicorn runs the app
with (unless ``worker=False``) one worker child kept alive beside it.

:func:`serve` is what ``spcache serve`` calls (:mod:`spcache.cli.serve` turns flags and
``SPCACHE_*`` variables into :class:`~service.settings.Settings`). Before anything starts
or says "listening" it refuses, with one line naming the problem
(:class:`~cache_store.errors.UsageError`): a cache path that is a file or cannot be
created, a worker that could never run (``--backend kaolin`` on a non-CUDA device), a size
limit without a worker or smaller than what is stored, a port in use or not this
machine's (bound here, before the worker starts, and handed to uvicorn as it is), an
inherited ``--fd`` that is no listening TCP socket.

SIGTERM and SIGINT (and SIGHUP, which the dispatcher turns into SIGTERM) shut uvicorn down
and then stop the worker child; the worker also ends by itself if this process is killed
outright (it is told this process's pid, see :mod:`service.supervisor`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Iterator

from cache_store.errors import UsageError
from service.settings import Settings

__all__ = [
    "bind_listener",
    "check_start",
    "inherited_listener",
    "serve",
    "worker_backend_problem",
]

log = logging.getLogger(__name__)


def check_start(settings: Settings, *, max_size: int | None = None) -> None:
    """Refuse (:class:`~cache_store.errors.UsageError`, one line) what would stop the
    service or its worker; creates the cache directory when it is missing."""
    if settings.cache.exists() and not settings.cache.is_dir():
        raise UsageError(f"{settings.cache}: is a file, not a cache directory")
    try:
        settings.cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"{settings.cache}: cannot create the cache directory ({exc.strerror or exc})"
        ) from None
    refused = worker_backend_problem(settings)
    if refused:
        raise UsageError(refused)
    if max_size is not None:
        from cache_store.housekeeping import SizeLimit

        if not settings.worker:
            raise UsageError(
                "--max-size is kept by the worker; with --no-worker give it to "
                "`spcache worker` instead"
            )
        SizeLimit(settings.cache, max_size).check_start()  # LimitTooSmall: exit 2


def worker_backend_problem(settings: Settings) -> str | None:
    """Why the worker child could never start with these options, or None: Kaolin's SPC
    ops are CUDA-only, so ``--backend kaolin`` with a non-CUDA ``--device`` is refused
    here, in one line, rather than by a worker that the supervisor would restart.
    Decided from the (checked) device string alone: the API process never imports torch."""
    device = settings.worker_device
    if not settings.worker or settings.worker_backend != "kaolin" or device in (None, "auto"):
        return None
    if str(device).split(":", 1)[0] == "cuda":
        return None
    return (
        f"--backend kaolin needs a CUDA --device (Kaolin's SPC ops are CUDA-only), "
        f"not {device}; use --backend torch or auto there"
    )


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (port 0: one the system picks),
    bound before anything starts so a busy port is one line instead of a worker started
    for nothing, and handed to uvicorn as it is (no probe-then-bind race). Raises
    :class:`~cache_store.errors.UsageError` saying why it cannot listen there (in use, not
    an address of this machine, not permitted)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(
                f"cannot listen on {host}:{port}: the port is in use (pick another --port, "
                f"e.g. --port {port + 1} or --port 0 for any free one, or stop what holds "
                f"port {port})"
            ) from None
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def inherited_listener(fd: int, host: str | None, port: int | None) -> socket.socket:
    """The bound TCP socket inherited as file descriptor ``fd`` (``--fd``), listening.
    Raises :class:`~cache_store.errors.UsageError` naming the descriptor when it is not
    one, or when ``--host`` or ``--port`` were given too (the socket's address is the one
    served)."""
    if host is not None or port is not None:
        raise UsageError("--fd serves the inherited socket's address: leave out --host and --port")
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise UsageError(f"--fd {fd}: not a socket ({exc.strerror or exc})") from None
    try:
        bound = sock.getsockname()
        if sock.type != socket.SOCK_STREAM or sock.family not in (
            socket.AF_INET,
            socket.AF_INET6,
        ):
            raise UsageError(f"--fd {fd}: not a TCP socket")
        if not bound[1]:
            raise UsageError(f"--fd {fd}: the socket is not bound to an address")
        sock.listen(2048)  # already listening (socket activation) or bound only
    except (OSError, UsageError) as exc:
        sock.detach()  # the descriptor stays the parent's to close
        if isinstance(exc, UsageError):
            raise
        raise UsageError(f"--fd {fd}: cannot listen on it ({exc.strerror or exc})") from None
    return sock


def serve(
    settings: Settings,
    *,
    listener: socket.socket | None = None,
    max_size: int | None = None,
    time_limit_s: float | None = None,
) -> int:
    """Check (:func:`check_start`), bind ``settings.host:port`` unless a ``listener`` is
    given (:func:`inherited_listener`), then serve on it until SIGTERM/SIGINT, with one
    worker child unless ``settings.worker`` is false; returns 0. ``max_size`` and
    ``time_limit_s`` go to the worker child (``--max-size``, ``--time-limit``)."""
    import uvicorn

    from service.app import create_app
    from service.supervisor import WorkerSupervisor, worker_command

    check_start(settings, max_size=max_size)
    if listener is None:
        listener = bind_listener(settings.host, settings.port)
        # --port 0: the port the system picked is the one logged and served
        settings = settings.model_copy(update={"port": listener.getsockname()[1]})
    supervisor = None
    log.info("spcache serve: cache %s", settings.cache.resolve())
    log.info(
        "spcache serve: warm-up sources must lie under %s",
        ", ".join(str(r) for r in settings.source_roots),
    )
    if settings.worker:
        supervisor = WorkerSupervisor(
            worker_command(
                str(settings.cache),
                device=settings.worker_device,
                backend=settings.worker_backend,
                log_level=settings.log_level,
                source_roots=settings.source_roots,
                extra=_worker_options(max_size, time_limit_s),
            ),
            max_backoff_s=settings.worker_restart_max_s,
            cache=settings.cache,
        )
        log.info(
            "spcache serve: worker child on device %s (backend %s)",
            settings.worker_device or "auto",
            settings.worker_backend,
        )
        supervisor.start()
    else:
        log.info(
            "spcache serve: no worker child (--no-worker); run `spcache worker --cache %s`",
            settings.cache,
        )
    log.info("spcache serve: listening on %s", settings.url)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=10,
        log_config=None,
        ssl_certfile=settings.tls_certfile,
        ssl_keyfile=settings.tls_keyfile,
    )

    class Server(uvicorn.Server):
        # uvicorn re-raises a caught SIGTERM/SIGINT once it has shut down (so the exit
        # status says "terminated by signal"); stop the worker child before that.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    if supervisor is not None:
                        supervisor.stop()

    try:
        Server(config).run(sockets=[listener])
    finally:
        listener.close()
        if supervisor is not None:
            supervisor.stop()
    return 0


def _worker_options(max_size: int | None, time_limit_s: float | None) -> list[str]:
    """The worker child's options that ``spcache serve`` passes on as they were given."""
    extra = [] if max_size is None else ["--max-size", str(max_size)]
    if time_limit_s is not None:
        extra += ["--time-limit", repr(time_limit_s)]
    return extra
