"""``spcache serve``: the service under uvicorn, plus (unless ``--no-worker``) one worker child.

``spcache.cli`` hands the ``serve`` subcommand here by module name
(``configure_parser(parser)``, ``log_level(args)`` for its one logging setup, then
``run(args)``); ``python -m service.cli`` runs it alone. Flags override ``SPCACHE_*``
environment variables, which override defaults.

SIGTERM and SIGINT (and SIGHUP, which the dispatcher turns into SIGTERM) shut uvicorn down
and then stop the worker child; the worker also ends by itself if this process is killed
outright (it is told this process's pid, see ``service.supervisor``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import socket
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import ValidationError

from service.settings import Settings

__all__ = [
    "configure_parser",
    "run",
    "main",
    "settings_from_args",
    "log_level",
    "bind_listener",
    "inherited_listener",
    "serve",
]

log = logging.getLogger(__name__)


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--cache", help="cache directory (env SPCACHE_CACHE)")
    parser.add_argument(
        "--host", help="address to bind (default 127.0.0.1; anything but loopback needs a token)"
    )
    parser.add_argument("--port", type=int, help="port (default 8000; 0: any free port, logged)")
    parser.add_argument(
        "--fd",
        type=int,
        metavar="N",
        help="serve on an already bound TCP socket inherited as file descriptor N "
        "(socket activation, a supervisor or a test that bound it first); its address "
        "replaces --host/--port",
    )
    parser.add_argument(
        "--token",
        help="bearer token for mutating routes (env SPCACHE_TOKEN; "
        "prefer the environment: flags show in ps)",
    )
    parser.add_argument(
        "--source-root",
        action="append",
        dest="source_roots",
        metavar="DIR",
        help="warm-up sources must resolve inside one of these (repeatable; "
        "env SPCACHE_SOURCE_ROOTS, os.pathsep-separated; default: cwd)",
    )
    parser.add_argument(
        "--no-worker",
        action="store_false",
        dest="worker",
        default=None,
        help="do not start a worker child (run `spcache worker` elsewhere)",
    )
    parser.add_argument("--device", dest="worker_device", help="the worker's device (e.g. cuda:0)")
    parser.add_argument("--backend", dest="worker_backend", help="the worker's SPC ops backend")
    parser.add_argument("--max-body-bytes", type=int, help="largest request body (default 1 MiB)")
    parser.add_argument("--log-level", help="debug, info, warning, error (default info)")
    parser.add_argument(
        "--max-size",
        metavar="SIZE",
        help="keep the cache's records under SIZE (bytes, or 500M, 2G): the "
        "worker removes least recently used fingerprints after each batch",
    )
    parser.add_argument(
        "--tls-certfile",
        metavar="PEM",
        help="serve HTTPS with this "
        "certificate chain (env SPCACHE_TLS_CERTFILE; needs --tls-keyfile)",
    )
    parser.add_argument(
        "--tls-keyfile",
        metavar="PEM",
        help="the certificate's private key (env SPCACHE_TLS_KEYFILE)",
    )
    return parser


_FLAG_FIELDS = (
    "cache",
    "host",
    "port",
    "token",
    "source_roots",
    "worker",
    "worker_device",
    "worker_backend",
    "max_body_bytes",
    "log_level",
    "tls_certfile",
    "tls_keyfile",
)


def settings_from_args(args: argparse.Namespace, listener: socket.socket | None = None) -> Settings:
    """Settings from the environment, overridden by the flags that were given (and by
    the address of an inherited ``listener``, which is where the service answers)."""
    given: dict[str, Any] = {
        name: getattr(args, name) for name in _FLAG_FIELDS if getattr(args, name, None) is not None
    }
    if listener is not None:
        given["host"], given["port"] = listener.getsockname()[:2]
    return Settings(**given)


def log_level(args: argparse.Namespace) -> str | None:
    """The level the settings ask for (flag, then ``SPCACHE_LOG_LEVEL``, then info); None
    when the settings do not validate (``run`` then reports why)."""
    try:
        return settings_from_args(args).log_level
    except ValidationError:
        return None


def run(args: argparse.Namespace) -> int:
    inherited = None
    if getattr(args, "fd", None) is not None:
        try:
            inherited = inherited_listener(args.fd, args.host, args.port)
        except ValueError as exc:
            sys.stderr.write(f"spcache serve: {exc}\n")
            return 2
    try:
        settings = settings_from_args(args, inherited)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: "
            f"{e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        sys.stderr.write(f"spcache serve: {problems}\n")
        return 2
    if settings.cache.exists() and not settings.cache.is_dir():
        sys.stderr.write(f"spcache serve: {settings.cache}: is a file, not a cache directory\n")
        return 2
    try:
        settings.cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        sys.stderr.write(
            f"spcache serve: {settings.cache}: cannot create the cache "
            f"directory ({exc.strerror or exc})\n"
        )
        return 2
    refused = worker_backend_problem(settings)
    if refused:
        sys.stderr.write(f"spcache serve: {refused}\n")
        return 2
    max_size = None
    if getattr(args, "max_size", None) is not None:
        from cache_store.housekeeping import LimitTooSmall, SizeLimit, parse_size

        if not settings.worker:
            sys.stderr.write(
                "spcache serve: --max-size is kept by the worker; with "
                "--no-worker give it to `spcache worker` instead\n"
            )
            return 2
        try:
            max_size = parse_size(args.max_size)
            SizeLimit(settings.cache, max_size).check_start()
        except (LimitTooSmall, ValueError) as exc:
            sys.stderr.write(f"spcache serve: {exc}\n")
            return 2
    listener = inherited
    if listener is None:
        try:  # bound now, before the worker starts, and handed to uvicorn as it is
            listener = bind_listener(settings.host, settings.port)
        except ValueError as exc:
            sys.stderr.write(f"spcache serve: {exc}\n")
            return 2
        # --port 0: the port the system picked is the one logged and served
        settings = settings.model_copy(update={"port": listener.getsockname()[1]})
    return serve(settings, listener, max_size=max_size)


def worker_backend_problem(settings: Settings) -> str | None:
    """Why the worker child could never start with these options, or None: Kaolin's SPC
    ops are CUDA-only, so ``--backend kaolin`` with a non-CUDA ``--device`` is refused
    here, in one line, rather than by a worker that the supervisor would restart.
    Decided from the strings alone: the API process never imports torch."""
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
    ValueError saying why it cannot listen there (in use, not an address of this
    machine, not permitted)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(
                f"cannot listen on {host}:{port}: the port is in use (pick another "
                "--port, or stop what holds it)"
            ) from None
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def inherited_listener(fd: int, host: str | None, port: int | None) -> socket.socket:
    """The bound TCP socket inherited as file descriptor ``fd`` (``--fd``), listening.
    Raises ValueError naming the descriptor when it is not one, or when ``--host`` or
    ``--port`` were given too (the socket's address is the one served)."""
    if host is not None or port is not None:
        raise ValueError("--fd serves the inherited socket's address: leave out --host and --port")
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ValueError(f"--fd {fd}: not a socket ({exc.strerror or exc})") from None
    try:
        bound = sock.getsockname()
        if sock.type != socket.SOCK_STREAM or sock.family not in (
            socket.AF_INET,
            socket.AF_INET6,
        ):
            raise ValueError(f"--fd {fd}: not a TCP socket")
        if not bound[1]:
            raise ValueError(f"--fd {fd}: the socket is not bound to an address")
        sock.listen(2048)  # already listening (socket activation) or bound only
    except (OSError, ValueError) as exc:
        sock.detach()  # the descriptor stays the parent's to close
        if isinstance(exc, ValueError):
            raise
        raise ValueError(f"--fd {fd}: cannot listen on it ({exc.strerror or exc})") from None
    return sock


def serve(settings: Settings, listener: socket.socket, *, max_size: int | None = None) -> int:
    """Serve the app on ``listener`` (bound by :func:`bind_listener` or inherited) until
    SIGTERM/SIGINT, with one worker child unless ``settings.worker`` is false."""
    import uvicorn

    from service.app import create_app
    from service.supervisor import WorkerSupervisor, worker_command

    settings.cache.mkdir(parents=True, exist_ok=True)
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
                extra=() if max_size is None else ("--max-size", str(max_size)),
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m service.cli``: serve without the ``spcache`` dispatcher."""
    parser = configure_parser(
        argparse.ArgumentParser(prog="spcache serve", description=__doc__.splitlines()[0])
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=(log_level(args) or "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
