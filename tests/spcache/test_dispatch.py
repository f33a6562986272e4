"""The command line (:mod:`spcache.cli`): dispatch, shared options, usage errors and exit
statuses (no device work)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cache_store.errors import ParameterError
from spcache import cli
from spcache.cli import COMMANDS, main
from spcache.cli.precompute import parse_params
from tests.conftest import REPO_ROOT
from tests.helpers.procs import run, run_spcache
from tests.helpers.recipes import BUILTINS, known_names


def _touch(path: Path, text: str = "0 0 0\n1 1 1\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_parse_params() -> None:
    assert parse_params(["level=8", "surface_sigma=0.02", "uniform_queries=1e3", "x=abc"]) == {
        "level": 8,
        "surface_sigma": 0.02,
        "uniform_queries": 1000.0,
        "x": "abc",
    }
    with pytest.raises(ParameterError, match="KEY=VALUE"):
        parse_params(["level"])
    with pytest.raises(ParameterError, match="more than once"):
        parse_params(["level=1", "level=2"])


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _touch(tmp_path / "a.xyz")
    cache = tmp_path / "cache"
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["precompute", str(src), "--cache", str(cache)]) == 2  # no --recipe
    assert main(["precompute", str(src), "--recipe", "nope", "--cache", str(cache)]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'nope'; known: " in err and known_names(err) >= BUILTINS, err
    assert (
        main(
            [
                "precompute",
                str(src),
                "--recipe",
                "spc",
                "--param",
                "level=99",
                "--cache",
                str(cache),
            ]
        )
        == 2
    )
    assert "level: 99 is above the maximum" in capsys.readouterr().err
    assert (
        main(
            [
                "precompute",
                str(src),
                "--recipe",
                "spc",
                "--param",
                "colour=1",
                "--cache",
                str(cache),
            ]
        )
        == 2
    )
    assert "colour: unknown parameter" in capsys.readouterr().err
    assert (
        main(["precompute", str(tmp_path / "missing"), "--recipe", "spc", "--cache", str(cache)])
        == 2
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["precompute", str(empty), "--recipe", "spc", "--cache", str(cache)]) == 2
    assert "no supported source files" in capsys.readouterr().err
    assert (
        main(["precompute", str(src), "--recipe", "spc", "--device", "tpu", "--cache", str(cache)])
        == 2
    )
    capsys.readouterr()
    # kaolin on the CPU cannot run: one line, before the cache or any sample is touched
    assert (
        main(
            [
                "precompute",
                str(src),
                "--recipe",
                "spc",
                "--device",
                "cpu",
                "--backend",
                "kaolin",
                "--cache",
                str(cache),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.splitlines() == [
        (
            "spcache precompute: backend 'kaolin' is unavailable: device cpu is not a CUDA device "
            "(Kaolin's SPC ops are CUDA-only); use --backend torch or auto there"
        )
    ]
    assert not cache.exists()
    assert main(["--help"]) == 0
    assert "precompute" in capsys.readouterr().out


def test_dispatch_table_is_a_plain_dict_of_the_command_package_modules() -> None:
    """One layer: every command is a module of spcache.cli named after it."""
    assert type(COMMANDS) is dict
    for name, (module, help_) in COMMANDS.items():
        assert module == f"spcache.cli.{name}" + ("_" if name == "import" else "")
        assert (REPO_ROOT / (module.replace(".", "/") + ".py")).is_file() and help_


def test_missing_command_module_fails_clearly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli.COMMANDS, "export", ("workers.no_such_module", "export a snapshot"))
    assert main(["export", "--anything"]) == 2
    err = capsys.readouterr().err
    assert "command 'export' is unavailable" in err and "workers.no_such_module" in err


def test_dispatch_reaches_a_module_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "fakecmd.py"
    pkg.write_text(
        "def configure_parser(p):\n    p.add_argument('--n', type=int)\n"
        "def run(args):\n    return args.n\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fakecmd", "a fake command"))
    assert main(["fake", "--n", "7"]) == 7
    assert main(["fake", "--n", "x"]) == 2


def test_python_dash_m_spcache_is_the_one_way_in_besides_the_script() -> None:
    out = run_spcache("--help")
    assert out.returncode == 0 and "precompute" in out.stdout
    for back_door in ("workers", "service.cli", "workers.worker_loop"):
        out = run([sys.executable, "-m", back_door, "--help"])
        assert out.stdout == "" and "usage:" not in out.stderr, back_door  # runs nothing


def test_no_arguments_shows_usage_without_internal_names() -> None:
    out = run_spcache()
    assert out.returncode == 2
    assert "usage: spcache" in out.stderr and "COMMAND" in out.stderr
    assert "rest" not in out.stderr.replace("interest", "")
    for name in COMMANDS:
        assert name in out.stderr


@pytest.mark.parametrize("command", ["serve", "verify", "stats", "export", "recipes"])
def test_cpu_side_commands_import_neither_torch_nor_workers(command: str) -> None:
    code = (
        "import sys; from spcache.cli import resolve, subcommand_parser; "
        f"target = resolve({command!r}); assert not isinstance(target, str), target; "
        f"subcommand_parser({command!r}, target); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'workers'}); "
        "assert not bad, bad"
    )
    out = run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr[-2000:]


def test_recipes_lists_every_parameter_with_default_and_bounds_from_the_schema() -> None:
    from cache_store.recipes.table import param_bounds
    from cache_store.recipes.registry import RECIPE_SPECS

    table = run_spcache("recipes").stdout
    helptext = run_spcache("precompute", "--help").stdout
    for spec in RECIPE_SPECS.values():
        heading = f"{spec.name} (version {spec.version})"
        assert heading in table
        # this recipe's block: from its heading to the next blank-free heading line
        block = table.split(heading, 1)[1].split("\n")[1:]
        block = block[
            : next(
                (i for i, line in enumerate(block) if line and not line.startswith(" ")), len(block)
            )
        ]
        for name, param in spec.params.items():
            line = next(line for line in block if line.split() and line.split()[0] == name)
            assert repr(param.default) in line.split() and param_bounds(param) in line
            assert line in helptext
    as_json = json.loads(run_spcache("recipes", "--json").stdout)
    assert {
        name: {k: v for k, v in entry.items() if k not in ("origin", "code_digest")}
        for name, entry in as_json.items()
    } == {name: spec.as_json() for name, spec in RECIPE_SPECS.items()}
    assert as_json["spc"]["origin"]["kind"] == "builtin"
    assert as_json["spc"]["origin"]["package"] == "spcache"
    assert "--loaders" in helptext and "--skip-failed" in helptext
    assert "pure PyTorch" in " ".join(helptext.split())  # --backend says what each means


def test_the_recipe_is_validated_before_sources_are_searched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "precompute",
                str(tmp_path / "missing"),
                "--recipe",
                "nope",
                "--cache",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "unknown recipe 'nope'" in err and "missing" not in err


def test_loaders_is_the_one_flag_for_loader_processes() -> None:
    parser = cli.subcommand_parser("precompute", cli.resolve("precompute"))
    base = ["src", "--recipe", "spc", "--cache", "c"]
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--jobs", "3"])
    assert parser.parse_args(base + ["--loaders", "4"]).loaders == 4
    assert parser.parse_args(base).loaders is None and parser.parse_args(base).skip_failed is False


def test_ctrl_c_while_the_command_imports_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted_import(name: str) -> object:
        raise KeyboardInterrupt  # as Ctrl-C lands while torch imports

    monkeypatch.setattr(cli, "resolve", interrupted_import)
    assert main(["precompute", "x.obj", "--cache", "c"]) == 130
    assert capsys.readouterr().err == "spcache: interrupted\n"


def test_minus_v_and_minus_q_work_before_and_after_the_command(tmp_path: Path) -> None:
    """The dispatcher's -v/-q: in any position, repeatable, summed."""

    def loud(*argv: str) -> str:
        out = run_spcache(*argv, cwd=tmp_path)
        assert out.returncode == 2, out.stderr  # no such cache: still logs at start
        return out.stderr

    debug = " DEBUG spcache.cli: spcache stats: pid "
    assert debug not in loud("stats", "--cache", "nope")
    assert debug not in loud("-v", "stats", "--cache", "nope")
    assert debug in loud("-vv", "stats", "--cache", "nope")
    assert debug in loud("stats", "-vv", "--cache", "nope")
    assert debug in loud("-v", "stats", "--cache", "nope", "-v")
    assert debug not in loud("-vv", "stats", "--cache", "nope", "-q")


def test_every_command_maps_an_error_class_to_the_same_exit_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One table: a command raising an error class exits as every other command does, in
    one line naming the command (no traceback)."""
    from cache_store.errors import (
        CacheDamaged,
        SpcacheError,
        StoreBusy,
        StoreFull,
        UnknownName,
        UsageError,
    )
    from spcache.cli.exits import EXIT_BY_ERROR, exit_status

    raised: list[BaseException] = []

    def failing(args: object) -> int:
        raise raised[-1]

    cases = [
        (UsageError("bad"), 2),
        (UnknownName("recipe", "x", ["spc"]), 2),
        (StoreFull("/c", "disk full"), 1),
        (StoreBusy("busy"), 1),
        (CacheDamaged("/c", "page"), 1),
        (SpcacheError("not exported"), 1),
        (FileNotFoundError(2, "No such file", "/x"), 2),
        (ValueError("size 5X"), 2),
    ]
    for name in ("precompute", "export", "import", "merge", "stats", "rm"):
        module = cli.resolve(name)
        monkeypatch.setattr(module, "run", failing)
        for exc, status in cases:
            raised.append(exc)
            assert exit_status(exc) == status
            assert main(_minimal_args(name, tmp_path)) == status
            err = capsys.readouterr().err
            assert err.startswith(f"spcache {name}: ") and err.count("\n") == 1, err
    assert EXIT_BY_ERROR[-1][0] is ValueError  # a bug (TypeError, ...) keeps its traceback
    raised.append(TypeError("a bug"))
    with pytest.raises(TypeError):
        main(_minimal_args("stats", tmp_path))


def _minimal_args(name: str, tmp_path: Path) -> list[str]:
    cache = ["--cache", str(tmp_path / "cache")]
    return {
        "precompute": [name, "src", "--recipe", "spc", *cache],
        "export": [name, "0" * 32, *cache, "--to", str(tmp_path / "x.zarr")],
        "import": [name, str(tmp_path / "x.zarr"), *cache],
        "merge": [name, str(tmp_path / "x.zarr")],
        "stats": [name, *cache],
        "rm": [name, "0" * 32, *cache],
    }[name]


def test_output_to_a_closed_pipe_ends_quietly_with_the_sigpipe_status(tmp_path: Path) -> None:
    """``spcache recipes | head -c 0`` and the like: the reader went away before the
    command wrote; it ends with 141 (128 + SIGPIPE, as a shell reports for any tool) and
    says nothing, no BrokenPipeError traceback."""
    import os
    import subprocess

    from tests.helpers.housekeeping import add_fingerprint

    cache = tmp_path / "cache"
    for level in (3, 4, 5):  # the README's `stats --json | head -c 600`: more than 600 bytes
        add_fingerprint(cache, level, 4, 200)
    for argv in (
        ["recipes"],
        ["recipes", "--json"],
        ["stats", "--cache", "cache", "--json"],
        ["ls", "--cache", "cache"],
        ["stats", "--cache", "nope", "--json"],
    ):
        read, write = os.pipe()
        os.close(read)  # deterministic: the reader is gone before the first write
        try:
            out = subprocess.run(
                [sys.executable, "-m", "spcache", *argv],
                cwd=tmp_path,
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
        finally:
            os.close(write)
        if "nope" in argv:  # nothing for stdout: the error line and 2, as ever
            assert out.returncode == 2 and "spcache stats: nope: no such" in out.stderr
            continue
        assert out.returncode == 141, (argv, out.stderr)
        assert "Traceback" not in out.stderr and "Broken pipe" not in out.stderr, out.stderr


def test_every_door_takes_its_defaults_from_the_options() -> None:
    """spcache.precompute's signature, the CLI flags and the worker show the same
    defaults as EngineOptions (written nowhere else)."""
    import argparse
    import inspect

    import spcache
    from cache_store.engine_options import EngineOptions
    from spcache.cli import resolve, subcommand_parser

    defaults = EngineOptions()
    signature = inspect.signature(spcache.precompute).parameters
    for name in ("device", "backend", "loaders", "query_chunk", "write_batch", "skip_failed"):
        assert signature[name].default == getattr(defaults, name), name
    for command in ("precompute", "worker"):
        parser: argparse.ArgumentParser = subcommand_parser(command, resolve(command))
        argv = ["s", "--recipe", "spc"] if command == "precompute" else []
        args = parser.parse_args([*argv, "--cache", "c"])
        assert (args.device, args.backend, args.loaders) == ("auto", "auto", None), command
    args = subcommand_parser("precompute", resolve("precompute")).parse_args(
        ["s", "--cache", "c", "--recipe", "spc"]
    )
    assert (args.query_chunk, args.write_batch) == (defaults.query_chunk, defaults.write_batch)
