"""``spcache serve``: the HTTP service under uvicorn, plus (unless ``--no-worker``) one
worker child (``python -m spcache worker``).

Flags override ``SPCACHE_*`` environment variables, which override defaults
(:class:`service.settings.Settings`); the service itself is
:func:`service.launch.serve`, which refuses what would stop it in one line (exit 2)
before it starts anything, binds ``--host:--port`` (0: any free port, logged) or serves
a socket inherited as ``--fd N``. Logging is at INFO unless ``--log-level`` (or
``SPCACHE_LOG_LEVEL``) says otherwise, or ``-v``/``-q`` move it; the worker child logs
at the same level.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from spcache.cli.args import add_backend, add_cache, add_device, add_max_size
from spcache.cli.args import add_source_roots, add_time_limit

__all__ = ["DEFAULT_LOG_LEVEL", "configure_parser", "log_level", "run", "settings_from_args"]

DEFAULT_LOG_LEVEL = logging.INFO


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_cache(parser, "cache directory (env SPCACHE_CACHE)", required=False, local=True)
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
    add_source_roots(
        parser,
        "warm-up sources must resolve inside one of these (repeatable; "
        "env SPCACHE_SOURCE_ROOTS, os.pathsep-separated; default: cwd)",
    )
    parser.add_argument(
        "--no-worker",
        action="store_false",
        dest="worker",
        default=None,
        help="do not start a worker child (run `spcache worker` elsewhere)",
    )
    add_device(
        parser, "the worker's device: auto, cpu, cuda or cuda:N", dest="worker_device", default=None
    )
    add_backend(parser, dest="worker_backend", default=None)
    add_time_limit(parser)  # the worker child's
    parser.add_argument("--max-body-bytes", type=int, help="largest request body (default 1 MiB)")
    parser.add_argument("--log-level", help="debug, info, warning, error (default info)")
    add_max_size(
        parser,
        "keep the cache's records under SIZE (bytes, or 500M, 2G): the "
        "worker removes least recently used fingerprints after each batch",
    )
    parser.add_argument(
        "--tls-certfile",
        metavar="PEM",
        help="serve HTTPS with this certificate chain (env SPCACHE_TLS_CERTFILE; needs "
        "--tls-keyfile)",
    )
    parser.add_argument(
        "--tls-keyfile",
        metavar="PEM",
        help="the certificate's private key (env SPCACHE_TLS_KEYFILE)",
    )


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


def settings_from_args(args: argparse.Namespace, listener: Any = None) -> Any:
    """Settings from the environment, overridden by the flags that were given (and by
    the address of an inherited ``listener``, which is where the service answers)."""
    from service.settings import Settings

    given: dict[str, Any] = {
        name: getattr(args, name) for name in _FLAG_FIELDS if getattr(args, name, None) is not None
    }
    if listener is not None:
        given["host"], given["port"] = listener.getsockname()[:2]
    return Settings(**given)


def log_level(args: argparse.Namespace) -> str | None:
    """The level ``--log-level`` or ``SPCACHE_LOG_LEVEL`` asks for; None when neither
    does (INFO, moved by ``-v``/``-q``) or the settings do not validate (``run`` then
    says why)."""
    from pydantic import ValidationError

    try:
        settings = settings_from_args(args)
    except ValidationError:
        return None
    return settings.log_level if "log_level" in settings.model_fields_set else None


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from cache_store.errors import UsageError
    from cache_store.housekeeping import parse_size
    from service.launch import inherited_listener, serve

    listener = None if args.fd is None else inherited_listener(args.fd, args.host, args.port)
    try:
        settings = settings_from_args(args, listener)
    except ValidationError as exc:
        raise UsageError(_problems(exc)) from None
    # the level the dispatcher set (flag, environment, or INFO moved by -v/-q): uvicorn
    # and the worker child log at it too
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    settings = settings.model_copy(update={"log_level": level})
    max_size = None if args.max_size is None else parse_size(args.max_size)
    return serve(settings, listener=listener, max_size=max_size, time_limit_s=args.time_limit_s)


def _problems(exc: Any) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: "
        f"{e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )
