"""What one spcache read spends on its checks (small records against tensordict).

Writes ``--samples`` spc_query records (the workload of ``bench/peers.py``) into an
spcache LMDB cache and, when tensordict is installed (the ``bench`` extra), into a
tensordict memory-map, then times one process reading random ``ds[i]`` four ways,
interleaved round by round:

- ``spcache``: the real read (header parsed and validated, every field hashed);
- ``no field hashes``: the same with each field's xxh3 replaced by a comparison that
  always passes;
- ``no header parse``: the same with each record's validated header parsed once, before
  timing, and handed back on its reads (and the key check skipped, since it reads the
  parsed metadata);
- ``neither``: both replaced.

The replacements exist only inside this script, for the timing: they show what the
checks every read makes cost, next to a format that makes none. Rates are samples/s,
medians of ``--rounds``; ratios are to the real read in the same run.

    python bench/read_costs.py [--size small|large] [--samples 480] [--unique 16] [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cache_store.stores.base as store_base
import cache_store.format.decode as decode
import cache_store.format.header as header_format
from peers import SIZES, build_records, one_process, write_lmdb, write_tensordict

MODES = ("spcache", "no field hashes", "no header parse", "neither")


class _Passes(str):
    """A digest that equals any stored one (the hash replaced, for the timing only)."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = str.__hash__


class _NoFieldHashes:
    """Stands in for the ``xxhash`` module inside ``cache_store.format.decode``: field hashes
    always pass, the header's own checksum is still computed."""

    def __init__(self, real: Any) -> None:
        self.xxh3_128_hexdigest = real.xxh3_128_hexdigest
        self._passes = _Passes("")

    def xxh3_64_hexdigest(self, data: Any) -> str:
        return self._passes


def _set_mode(mode: str, parsed: dict[tuple[bytes, int], Any], real: dict[str, Any]) -> None:
    hashes = mode in ("spcache", "no header parse")
    parse = mode in ("spcache", "no field hashes")
    decode.xxhash = real["xxhash"] if hashes else _NoFieldHashes(real["xxhash"])
    if parse:
        header_format.parse_text = real["parse"]
        store_base.check_names_key = real["names_key"]
    else:
        header_format.parse_text = lambda raw, total, key: parsed[(raw, total)]
        store_base.check_names_key = lambda metadata, key: None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="record size, as in bench/peers.py (default: small, ~0.13 MB)",
    )
    parser.add_argument("--samples", type=int, default=480, help="records (default 480)")
    parser.add_argument(
        "--unique",
        type=int,
        default=16,
        help="distinct records computed, cycled to --samples (default 16)",
    )
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    args = parser.parse_args(argv)

    level, points, queries = SIZES[args.size]
    records = build_records(args.samples, args.unique, level, points, queries)
    root = Path(tempfile.mkdtemp(prefix="spcache-read-costs-"))
    factories = {"spcache": write_lmdb(root, records)}
    try:
        factories["tensordict"] = write_tensordict(root, records)
    except ImportError as exc:
        print(f"tensordict left out: {exc}")
    order = list(range(args.samples))
    random.Random(0).shuffle(order)

    real = {
        "xxhash": decode.xxhash,
        "parse": header_format.parse_text,
        "names_key": store_base.check_names_key,
    }
    parsed: dict[tuple[bytes, int], Any] = {}

    def remember(raw: bytes, total: int, key: str) -> Any:
        parsed[(raw, total)] = header = real["parse"](raw, total, key)
        return header

    header_format.parse_text = remember  # one untimed pass parses every header once
    ds = factories["spcache"]()
    for i in order:
        ds[i]
    header_format.parse_text = real["parse"]

    rates: dict[str, list[float]] = {}
    try:
        for _ in range(args.rounds):
            for mode in MODES:
                _set_mode(mode, parsed, real)
                rates.setdefault(mode, []).append(one_process(factories["spcache"](), order))
            _set_mode("spcache", parsed, real)
            if "tensordict" in factories:
                rates.setdefault("tensordict", []).append(
                    one_process(factories["tensordict"](), order)
                )
    finally:
        _set_mode("spcache", parsed, real)
    base = statistics.median(rates["spcache"])
    print(
        f"{args.size}: {args.samples} records, one process, random ds[i], "
        f"median of {args.rounds} rounds"
    )
    for name, got in rates.items():
        rate = statistics.median(got)
        print(f"  {name:18s} {rate:9,.0f}/s  {rate / base:5.2f}x  ({1e6 / rate:6.1f} us a read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
