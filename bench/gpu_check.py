"""The first thing to run on a GPU machine: one command, one markdown report.

On a CUDA machine it

1. notes the environment: torch, CUDA, the devices, and which SPC backend ``auto`` picks
   and why (Kaolin's version, or why it cannot run);
2. runs the ``gpu``-marked tests (``pytest -m gpu``) and records their outcome;
3. compares the Kaolin backend with the torch backend on CUDA, and the torch backend on
   CUDA with the CPU, bit for bit, on random and real shapes at levels 1-15:
   quantize, Morton codes both ways, octree (``sorted`` False and True), ``scan_octrees``
   (current and ``legacy_exsum``), point hierarchy, corners, queries with and without
   parents, dual octree and trinkets; on a second device too when there is one;
4. runs ``spc_sdf`` through the engine on open and closed meshes with each backend and
   compares the records (every field bit for bit except ``sdf``/``sdf_face``; the signs
   must be identical, ``|sdf|`` equal to float32 rounding);
5. measures the engine's shapes/s and peak device memory for ``spc_query`` at levels 8 and
   10, with no loader process and with loaders;

and writes the report (``--out``, default ``gpu_check_report.md``). Without CUDA it says
so in one line and exits 0.

    python bench/gpu_check.py [--out REPORT.md] [--quick] [--no-tests]

``--cpu-dry-run`` exercises steps 3-5 on the CPU (the torch backend against itself, no
Kaolin), to check the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gpu_check_report.md"),
        help="the markdown report (default gpu_check_report.md)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer points, levels and samples (about a minute)"
    )
    parser.add_argument("--no-tests", action="store_true", help="skip pytest -m gpu")
    parser.add_argument(
        "--meshes",
        type=Path,
        default=None,
        help="real meshes for the comparisons and timings (default: "
        "../shared/data/meshes beside the checkout, else the test corpus)",
    )
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the comparisons and timings on the CPU (torch backend only): "
        "checks this script where there is no GPU",
    )
    return parser


# --- shapes ----------------------------------------------------------------------------


def _mesh_files(folder: Path | None) -> list[Path]:
    candidates = (
        [folder]
        if folder
        else [
            Path(os.environ.get("SPCACHE_SHARED_DATA", REPO.parent / "shared" / "data")) / "meshes"
        ]
    )
    for candidate in candidates:
        if candidate and candidate.is_dir():
            files = sorted(
                p
                for p in candidate.iterdir()
                if p.suffix.lower() in (".obj", ".ply", ".stl", ".off")
            )
            if files:
                return files
    from tests.data import corpus  # a checkout has it: generated meshes

    root = corpus.ensure() / "meshes"
    return sorted(p for p in root.iterdir() if p.suffix.lower() in (".obj", ".ply", ".stl", ".off"))


def _random_shape(seed: int, n: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen)
    sphere = 0.95 * x / x.norm(dim=1, keepdim=True)
    cloud = torch.rand(n // 4, 3, generator=gen) * 2 - 1
    return torch.cat([sphere, cloud])


def _real_shape(path: Path, n: int, seed: int) -> Any:
    import torch

    from workers.sampling import compute_normalization, shape_points
    from workers.source_load import load_source

    source = load_source(path)
    norm = compute_normalization(source.path, source.used_points())
    return shape_points(source, norm, n, torch.Generator().manual_seed(seed)).to(torch.float32)


def _queries(points: Any, seed: int, level: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    n = len(points)
    edge = torch.tensor(
        [
            [-1.0 - 2.0 ** -(level + 1)] * 3,
            [1.0] * 3,
            [-1.0] * 3,
            [float("nan"), 0.0, 0.0],
            [40.0, 0.0, 0.0],
        ]
    )
    return torch.cat(
        [
            torch.rand(n, 3, generator=gen) * 2.2 - 1.1,
            points + 0.01 * torch.randn(points.shape, generator=gen),
            edge,
        ]
    )


# --- step 3: the ops, backend against backend ------------------------------------------


def _pipeline(ops: Any, x: Any, queries: Any, level: int) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    points = ops.quantize_points(x, level)
    out["points"] = points
    out["morton"] = ops.points_to_morton(points)
    out["unmorton"] = ops.morton_to_points(out["morton"])
    octree = ops.unbatched_points_to_octree(points, level)
    out["octree"] = octree
    ordered = points[torch.argsort(out["morton"], stable=True)]
    out["octree_sorted"] = ops.unbatched_points_to_octree(ordered, level, sorted=True)
    lengths = torch.tensor([len(octree)], dtype=torch.int32)
    out["max_level"], out["pyramids"], out["exsum"] = ops.scan_octrees(octree, lengths)
    with warnings.catch_warnings():  # the legacy layout is deprecated, and compared on purpose
        warnings.simplefilter("ignore", DeprecationWarning)
        _, out["pyramids_legacy"], out["exsum_legacy"] = ops.scan_octrees(
            octree, lengths, legacy_exsum=True
        )
    hierarchy = ops.generate_points(octree, out["pyramids"], out["exsum"])
    out["hierarchy"] = hierarchy
    out["corners"] = ops.points_to_corners(hierarchy)
    pyramid = out["pyramids"][0]
    for lvl in sorted({0, level // 2, level}):
        out[f"query{lvl}"] = ops.unbatched_query(octree, out["exsum"], queries, lvl)
        out[f"parents{lvl}"] = ops.unbatched_query(
            octree, out["exsum"], queries, lvl, with_parents=True
        )
    if level < 15:  # level-15 duals reach 2**15 on the far border, beyond int16
        out["dual"], out["pyramid_dual"] = ops.unbatched_make_dual(hierarchy, pyramid)
        out["trinkets"], out["trinket_parents"] = ops.unbatched_make_trinkets(
            hierarchy, pyramid, out["dual"], out["pyramid_dual"]
        )
    return out


def _differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    import torch

    bad = sorted(set(got) ^ set(want))
    for key in sorted(set(got) & set(want)):
        a, b = got[key], want[key]
        if isinstance(a, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.cpu(), b.cpu()):
                bad.append(key)
        elif a != b:
            bad.append(key)
    return bad


def _compare(label: str, run_a: Callable[[], dict], run_b: Callable[[], dict]) -> tuple[str, str]:
    try:
        bad = _differences(run_a(), run_b())
    except Exception as exc:  # noqa: BLE001 - the report says what broke, the check goes on
        return label, f"ERROR {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return label, "same" if not bad else "DIFFERENT: " + ", ".join(bad)


def compare_backends(
    devices: list[str], kaolin: Any, meshes: list[Path], levels: list[int], n: int
) -> list[tuple[str, str]]:
    """Rows ``(case, outcome)``: torch on each device against the CPU, Kaolin against torch."""
    from workers.ops import torch_spc

    rows = []
    shapes: list[tuple[str, Callable[[], Any]]] = [
        (f"random{seed}", lambda seed=seed: _random_shape(seed, n)) for seed in (1, 2)
    ]
    shapes += [(path.name, lambda path=path: _real_shape(path, n, 3)) for path in meshes[:3]]
    for name, make in shapes:
        try:
            x = make()
        except Exception as exc:  # noqa: BLE001 - an unreadable mesh is one row
            rows.append((name, f"ERROR loading: {type(exc).__name__}: {exc}"))
            continue
        for level in levels:
            q = _queries(x, level, level)
            on_cpu = None

            def cpu(x: Any = x, q: Any = q, level: int = level) -> dict:
                nonlocal on_cpu
                if on_cpu is None:
                    on_cpu = _pipeline(torch_spc, x, q, level)
                return on_cpu

            for device in devices:
                if device != "cpu":
                    rows.append(
                        _compare(
                            f"{name} L{level}: torch {device} vs cpu",
                            lambda d=device, x=x, q=q, level=level: _pipeline(
                                torch_spc, x.to(d), q.to(d), level
                            ),
                            cpu,
                        )
                    )
                if kaolin is not None and device != "cpu":
                    rows.append(
                        _compare(
                            f"{name} L{level}: kaolin {device} vs torch {device}",
                            lambda d=device, x=x, q=q, level=level: _pipeline(
                                kaolin, x.to(d), q.to(d), level
                            ),
                            lambda d=device, x=x, q=q, level=level: _pipeline(
                                torch_spc, x.to(d), q.to(d), level
                            ),
                        )
                    )
            if devices == ["cpu"]:  # the dry run: the torch backend against itself
                rows.append(
                    _compare(
                        f"{name} L{level}: torch cpu vs cpu",
                        cpu,
                        lambda x=x, q=q, level=level: _pipeline(
                            torch_spc, x.clone(), q.clone(), level
                        ),
                    )
                )
    return rows


# --- step 4: spc_sdf through the engine --------------------------------------------------


def _open_meshes(folder: Path) -> list[Path]:
    import numpy as np
    import trimesh

    box = trimesh.creation.box(extents=(1.0, 1.0, 1.0))
    lidless = trimesh.Trimesh(
        box.vertices, box.faces[box.triangles_center[:, 2] < 0.49], process=False
    )
    sphere = trimesh.creation.icosphere(subdivisions=3)
    centres = sphere.triangles_center
    holed = trimesh.Trimesh(
        sphere.vertices,
        np.concatenate(
            [sphere.faces[centres[:, 2] < 0.6], sphere.faces[np.abs(centres[:, 2]) < 0.1][:, ::-1]]
        ),
        process=False,
    )
    capsule = trimesh.creation.capsule(height=1.0, radius=0.4)
    paths = []
    for name, mesh in (("open_box", lidless), ("holed_sphere", holed), ("capsule", capsule)):
        path = folder / f"{name}.ply"
        mesh.export(path)
        paths.append(path)
    return paths


def _engine_records(
    cache: Path,
    recipe: str,
    params: dict,
    paths: list[Path],
    device: str,
    backend: str,
    loaders: int = 0,
) -> tuple[Any, dict[str, Any]]:
    from cache_store.format.decode import decode_record
    from cache_store.stores.opener import open_store
    from workers.engine import Engine

    with open_store(cache, readonly=False) as store:
        engine = Engine(store, recipe, params, device=device, backend=backend, loaders=loaders)
        summary = engine.run([(p.stem, str(p)) for p in paths])
        records = {
            k.split("/", 1)[1]: decode_record(store.get(k)).tensors
            for k in store.keys(prefix=engine.fingerprint + "/")
        }
    return summary, records


def compare_sdf(
    work: Path, devices: list[str], kaolin_ok: bool, meshes: list[Path], quick: bool
) -> list[tuple[str, str]]:
    import torch

    params = {
        "level": 6 if quick else 8,
        "surface_samples": 5000 if quick else 50_000,
        "near_samples": 2000 if quick else 20_000,
        "uniform_samples": 2000 if quick else 20_000,
    }
    paths = _open_meshes(work) + meshes[:2]
    _, cpu = _engine_records(work / "sdf-cpu", "spc_sdf", params, paths, "cpu", "torch")
    rows = []
    runs = [
        (d, b)
        for d in devices
        if d != "cpu"
        for b in (["torch", "kaolin"] if kaolin_ok else ["torch"])
    ]
    if devices == ["cpu"]:
        runs = [("cpu", "torch")]
    for device, backend in runs:
        label = f"spc_sdf {backend} on {device} vs cpu"
        try:
            summary, got = _engine_records(
                work / f"sdf-{device}-{backend}".replace(":", ""),
                "spc_sdf",
                params,
                paths,
                device,
                backend,
            )
        except Exception as exc:  # noqa: BLE001 - one row says what broke
            rows.append((label, f"ERROR {type(exc).__name__}: {exc}"))
            continue
        for sample, want in cpu.items():
            have = got.get(sample)
            if have is None:
                rows.append(
                    (
                        f"{label}: {sample}",
                        "MISSING ("
                        + "; ".join(e.reason for e in summary.errors if e.id == sample)
                        + ")",
                    )
                )
                continue
            exact = [
                k
                for k in want
                if k not in ("sdf", "sdf_face") and not torch.equal(want[k], have[k])
            ]
            signs = torch.equal(torch.signbit(want["sdf"]), torch.signbit(have["sdf"]))
            delta = float((want["sdf"].double() - have["sdf"].double()).abs().max())
            faces = float((want["sdf_face"] != have["sdf_face"]).double().mean())
            verdict = "same" if not exact and signs and delta <= 1e-5 else "DIFFERENT"
            fields = exact if exact else "all equal"
            rows.append(
                (
                    f"{label}: {sample}",
                    (
                        f"{verdict}: exact fields {fields}; signs "
                        f"{'identical' if signs else 'DIFFER'}; max |d sdf| {delta:.2e}; "
                        f"sdf_face differs on {100 * faces:.2f}% (equally near faces)"
                    ),
                )
            )
    return rows


# --- step 5: throughput and memory --------------------------------------------------------


def measure(work: Path, device: str, meshes: list[Path], quick: bool) -> list[tuple[str, ...]]:
    import shutil

    import torch

    count = 8 if quick else 48
    paths = []
    folder = work / "timing-sources"
    folder.mkdir(exist_ok=True)
    for i in range(count):  # distinct files: the engine skips nothing
        src = meshes[i % len(meshes)]
        dst = folder / f"{i:03d}_{src.name}"
        shutil.copyfile(src, dst)
        paths.append(dst)
    loaders = max(1, min(8, (os.cpu_count() or 2) - 1))
    rows: list[tuple[str, ...]] = []
    for level in (8, 10):
        params = {
            "level": level,
            "surface_samples": 20_000 if quick else 100_000,
            "uniform_queries": 20_000 if quick else 100_000,
            "surface_queries": 20_000 if quick else 100_000,
        }
        for n_loaders in (0, loaders):
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats(device)
            cache = work / f"timing-{level}-{n_loaders}"
            try:
                summary, _ = _engine_records(
                    cache, "spc_query", params, paths, device, "auto", loaders=n_loaders
                )
            except Exception as exc:  # noqa: BLE001 - one row says what broke
                rows.append(
                    (str(level), str(n_loaders), "ERROR", f"{type(exc).__name__}: {exc}", "", "")
                )
                continue
            peak = (
                torch.cuda.max_memory_allocated(device) / 2**20
                if device.startswith("cuda")
                else float("nan")
            )
            rate = summary.done / summary.wall_s if summary.wall_s else 0.0
            rows.append(
                (
                    str(level),
                    str(n_loaders),
                    summary.backend,
                    f"{rate:.2f}",
                    "n/a" if math.isnan(peak) else f"{peak:.0f}",
                    (
                        f"{summary.done} done, {summary.failed} failed, "
                        f"{summary.oom_backoffs} OOM back-offs"
                    ),
                )
            )
            shutil.rmtree(cache, ignore_errors=True)
    return rows


# --- the report ---------------------------------------------------------------------------


def _environment(devices: list[str]) -> tuple[list[str], Any]:
    import torch

    from workers.ops import kaolin_spc, select_backend

    lines = [
        (
            f"- python {platform.python_version()}, torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}"
        )
    ]
    for device in devices:
        if device.startswith("cuda"):
            props = torch.cuda.get_device_properties(device)
            lines.append(f"- {device}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
    backend, why = select_backend("auto", devices[0])
    lines.append(f"- `--backend auto` on {devices[0]}: **{backend.name}** ({why})")
    note = kaolin_spc.torch_version_note()
    if note:
        lines.append(f"- note: {note}")
    kaolin = backend if backend.name == "kaolin" else None
    return lines, kaolin


def _run_gpu_tests() -> tuple[str, str]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-rfEs",
            "-p",
            "no:cacheprovider",
            "tests",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
    return f"exit status {proc.returncode}", tail


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.cpu_dry_run:
        # ask a child interpreter: this process must not depend on a CUDA context that failed
        probe = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if probe.stdout.strip() != "True":
            print("gpu_check: no CUDA device here; nothing to check (run it on a GPU machine)")
            return 0
    import torch

    start = time.perf_counter()
    devices = (
        ["cpu"]
        if args.cpu_dry_run
        else [f"cuda:{i}" for i in range(min(2, torch.cuda.device_count()))]
    )
    report = [
        f"# spcache GPU check ({time.strftime('%Y-%m-%d %H:%M:%S')})",
        "",
        "## Environment",
        "",
    ]
    env, kaolin = _environment(devices)
    report += env
    failures = 0
    report += ["", "## gpu tests (`pytest -m gpu`)", ""]
    if args.no_tests or args.cpu_dry_run:
        report.append("skipped (--no-tests or --cpu-dry-run)")
    else:
        status, tail = _run_gpu_tests()
        failures += status != "exit status 0"
        report += [status, "", "```", tail, "```"]
    meshes = _mesh_files(args.meshes)
    levels = [1, 4, 8, 12, 15] if args.quick else list(range(1, 16))
    n = 2_000 if args.quick else 20_000
    steps: list[tuple[str, Callable[[], list]]] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        steps = [
            (
                "SPC ops: backends and devices, bit for bit",
                lambda: compare_backends(devices, kaolin, meshes, levels, n),
            ),
            (
                "spc_sdf through the engine (open and closed meshes)",
                lambda: compare_sdf(work, devices, kaolin is not None, meshes, args.quick),
            ),
        ]
        for title, step in steps:
            report += ["", f"## {title}", ""]
            try:
                rows = step()
            except Exception:  # noqa: BLE001 - the report carries the traceback
                failures += 1
                report += ["```", traceback.format_exc(), "```"]
                continue
            failures += sum(1 for _, outcome in rows if not outcome.startswith("same"))
            report += _table(("case", "outcome"), rows)
        report += ["", "## Worker throughput and peak device memory (spc_query, backend auto)", ""]
        try:
            rows = measure(work, devices[0], meshes, args.quick)
            report += _table(("level", "loaders", "backend", "shapes/s", "peak MiB", "notes"), rows)
        except Exception:  # noqa: BLE001 - the report carries the traceback
            failures += 1
            report += ["```", traceback.format_exc(), "```"]
    report += ["", f"{failures} problem(s); {time.perf_counter() - start:.0f}s in all."]
    args.out.write_text("\n".join(report) + "\n")
    print(f"gpu_check: {failures} problem(s); report in {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
