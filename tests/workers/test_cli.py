"""The command line: parsing, source discovery, dispatch and exit codes (no device work)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cache_store.errors import ParameterError, SourceError
from cache_store.sources.discover import discover_sources
from spcache import cli
from spcache.cli import COMMANDS, main
from tests.helpers.procs import run, run_spcache
from tests.helpers.recipes import BUILTINS, known_names
from workers.precompute_cli import parse_params


def _touch(path: Path, text: str = "0 0 0\n1 1 1\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_directory_discovery_is_recursive_sorted_and_ids_are_relative(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _touch(root / "b.xyz")
    _touch(root / "chairs" / "a1.OBJ")
    _touch(root / "chairs" / "deep" / "x.ply")
    _touch(root / "notes.md")
    _touch(root / ".hidden" / "y.obj")
    _touch(root / ".z.obj")
    items = discover_sources([root])
    assert items == [
        ("b", str(root / "b.xyz")),
        ("chairs/a1", str(root / "chairs" / "a1.OBJ")),
        ("chairs/deep/x", str(root / "chairs" / "deep" / "x.ply")),
    ]


def test_manifests_and_single_files(tmp_path: Path) -> None:
    a = _touch(tmp_path / "meshes" / "a.obj")
    elsewhere = _touch(tmp_path / "other" / "b.xyz")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "list.txt").write_text(f"# comment\n../meshes/a.obj\n\n{elsewhere}\n")
    assert discover_sources([tmp_path / "m" / "list.txt"]) == [
        ("a", str(tmp_path / "m" / "../meshes/a.obj")),
        ("b", str(elsewhere)),
    ]
    (tmp_path / "list.txt").write_text("# comment\nmeshes/a.obj\n\n" + str(a) + "\n")
    (tmp_path / "list.jsonl").write_text(json.dumps({"id": "first", "path": "meshes/a.obj"}) + "\n")
    assert discover_sources([tmp_path / "list.txt"]) == [
        ("meshes/a", str(tmp_path / "meshes/a.obj")),
        ("meshes/a", str(a)),
    ]
    assert discover_sources([tmp_path / "list.jsonl"]) == [
        ("first", str(tmp_path / "meshes/a.obj"))
    ]
    assert discover_sources([a]) == [("a", str(a))]


@pytest.mark.parametrize(
    "content,reason",
    [
        ("{not json\n", "line 1: not JSON"),
        ('{"id": "x"}\n', "line 1: expected an object"),
        ('["x", "y"]\n', "expected an object"),
    ],
)
def test_bad_jsonl_manifest(tmp_path: Path, content: str, reason: str) -> None:
    (tmp_path / "m.jsonl").write_text(content)
    with pytest.raises(SourceError, match=reason):
        discover_sources([tmp_path / "m.jsonl"])


def test_missing_source_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file"):
        discover_sources([tmp_path / "nope"])


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


def test_dispatch_table_is_a_plain_dict_of_import_targets() -> None:
    assert type(COMMANDS) is dict
    assert COMMANDS["worker"][0] == "workers.worker_cli"
    assert COMMANDS["serve"][0] == "service.cli"
    assert COMMANDS["precompute"][0].startswith("workers.")
    assert {
        c: COMMANDS[c][0].split(".")[0] for c in ("verify", "stats", "export", "recipes")
    } == dict.fromkeys(("verify", "stats", "export", "recipes"), "spcache")


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


@pytest.mark.parametrize("package", ["spcache", "workers"])
def test_python_dash_m_runs_the_cli(package: str) -> None:
    out = run([sys.executable, "-m", package, "--help"])
    assert out.returncode == 0 and "precompute" in out.stdout


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
    from cache_store.recipes.specs import RECIPE_SPECS

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
