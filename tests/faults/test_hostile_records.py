"""Case 7: 1,000 mutated record values, each rejected as corrupt with its key named.

Mutants are made from valid records with a fixed seed, in families: flipped bits
anywhere, truncation, header lengths 2^63 / 2^64-1 / one past the end, a header over the
100 MiB bound, and header edits that are *re-signed* (the header checksum recomputed, as
a bug or an attacker could) so that only the structural checks can catch them: shape x
dtype not matching the bytes, overlapping / gapped / out-of-range offsets, unknown
dtypes, bad shapes, duplicate keys, NaN, deep nesting, non-UTF-8, another format version,
field checksums that do not list the tensors, a BOOL byte of 2, trailing bytes; and
pickle payloads whose execution would create a canary file.

Every mutant goes through every reading surface: ``decode_record``, ``decode_arrays``,
``select_fields``, ``LMDBStore.get_record`` and ``verify`` (stored raw, past the writer's
checks), and the service (GET, GET with ``fields``, batch) read back by ``HTTPStore``.
Subset reads verify only the bytes they return (by design), so a mutant whose damage lies
in another field may pass them with its requested field intact; that is checked and
counted separately. Figures: mutants, rejections per surface (must be 100%), any other
exception type (must be 0), server errors other than a JSON ``CorruptRecord`` answer
(must be 0), canary files (must be 0).
"""

from __future__ import annotations

import json
import random
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import lmdb
import pytest
import xxhash

from cache_store.errors import CorruptRecord
from cache_store.stores.http import HTTPStore
from cache_store.stores.lmdb import LMDBStore
from cache_store.format.decode import decode_arrays, decode_record
from cache_store.format.encode import select_fields
from service.settings import Settings
from tests.helpers.synthetic import fingerprint_of, make_record
from tests.helpers.faults import env_int, report, served
from tests.helpers.service import TOKEN

MUTANTS = env_int("SPCACHE_FAULT_MUTANTS", 1000)
_LEN = struct.Struct("<Q")
_SLOT = b'"checksum":"'


# --------------------------------------------------------------------------- the format


def _split(value: bytes) -> tuple[dict, bytes]:
    (n,) = _LEN.unpack_from(value, 0)
    return json.loads(value[8 : 8 + n]), value[8 + n :]


def _signed(header_text: bytes, data: bytes) -> bytes:
    """Pad, fill in the header checksum the way the format defines it, and assemble."""
    text = header_text + b" " * (-(len(header_text) + 8) % 8)
    at = text.find(_SLOT)
    if at >= 0:
        at += len(_SLOT)
        blank = text[:at] + b"0" * 32 + text[at + 32 :]
        text = text[:at] + xxhash.xxh3_128_hexdigest(blank).encode() + text[at + 32 :]
    return _LEN.pack(len(text)) + text + data


def _resign(header: dict, data: bytes) -> bytes:
    return _signed(json.dumps(header, separators=(",", ":")).encode(), data)


def _pickle_payload(canary: Path, how: str) -> bytes:
    """Protocol-0 pickle opcodes, written out by hand (no pickle module anywhere)."""
    if how == "open":
        return (f"cbuiltins\nopen\n(S'{canary}'\nS'w'\ntR.").encode()
    return (f"cos\nsystem\n(S'touch {canary}'\ntR.").encode()


# --------------------------------------------------------------------------- mutants


Mutator = Callable[[bytes, random.Random], bytes]


def _tensor_names(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__")


def _edit(fn: Callable[[dict, random.Random], None]) -> Mutator:
    def mutate(value: bytes, rng: random.Random) -> bytes:
        header, data = _split(value)
        fn(header, rng)
        return _resign(header, data)

    return mutate


def _flip(value: bytes, rng: random.Random) -> bytes:
    out = bytearray(value)
    at = rng.randrange(len(out))
    out[at] ^= 1 << rng.randrange(8)
    return bytes(out)


def _flip_data(value: bytes, rng: random.Random) -> bytes:
    (n,) = _LEN.unpack_from(value, 0)
    out = bytearray(value)
    at = rng.randrange(8 + n, len(out))
    out[at] ^= 1 << rng.randrange(8)
    return bytes(out)


def _truncate(value: bytes, rng: random.Random) -> bytes:
    return value[: rng.randrange(len(value))]


def _length(n: int | None) -> Mutator:
    def mutate(value: bytes, rng: random.Random) -> bytes:
        return _LEN.pack(len(value) - 7 if n is None else n) + value[8:]

    return mutate


def _shape(header: dict, rng: random.Random) -> None:
    name = rng.choice([n for n in _tensor_names(header) if header[n]["shape"]])
    shape = header[name]["shape"]
    shape[rng.randrange(len(shape))] += rng.choice([1, 2, 7])


def _dtype(header: dict, rng: random.Random) -> None:
    name = rng.choice(_tensor_names(header))
    header[name]["dtype"] = {
        "U8": "I16",
        "I16": "I32",
        "I32": "F64",
        "F32": "I64",
        "F64": "F32",
        "I64": "U8",
    }.get(header[name]["dtype"], "F64")


def _overlap(header: dict, rng: random.Random) -> None:
    names = sorted(_tensor_names(header), key=lambda n: header[n]["data_offsets"][0])
    i = rng.randrange(1, len(names))
    prev, cur = header[names[i - 1]], header[names[i]]
    size = cur["data_offsets"][1] - cur["data_offsets"][0]
    begin = max(prev["data_offsets"][1] - rng.randint(1, 8), 0)
    cur["data_offsets"] = [begin, begin + size]


def _same_offsets(header: dict, rng: random.Random) -> None:
    a, b = rng.sample(_tensor_names(header), 2)
    header[b]["data_offsets"] = list(header[a]["data_offsets"])


def _out_of_range(header: dict, rng: random.Random) -> None:
    name = rng.choice(_tensor_names(header))
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = rng.choice(
        [[begin, end + 2**40], [-8, end], [end, begin], [begin, 2**63]]
    )


def _bad_value(header: dict, rng: random.Random) -> None:
    name = rng.choice(_tensor_names(header))
    entry = header[name]
    choice = rng.randrange(7)
    if choice == 0:
        entry["dtype"] = rng.choice(["F128", "str", "", "object", "O"])
    elif choice == 1:
        entry["shape"] = rng.choice([[-1], [True], ["3"], [1.5], None, {}])
    elif choice == 2:
        entry["data_offsets"] = rng.choice([[0], [0, 1, 2], ["0", "4"], None, [True, 4]])
    elif choice == 3:
        entry["extra"] = 1
    elif choice == 4:
        del entry["shape"]
    elif choice == 5:
        header[name] = rng.choice([[], "x", 3, None])
    else:
        header["__metadata__"]["field_checksums"] = rng.choice(["{}", "not json", "[]"])


def _version(header: dict, rng: random.Random) -> None:
    header["__metadata__"]["format_version"] = rng.choice(["3", "0", "", "1.0", "1"])


def _metadata_type(header: dict, rng: random.Random) -> None:
    header["__metadata__"]["recipe"] = rng.choice([1, None, ["spc"], {"a": "b"}])


def _raw_header(kind: str) -> Mutator:
    def mutate(value: bytes, rng: random.Random) -> bytes:
        header, data = _split(value)
        text = json.dumps(header, separators=(",", ":"))
        if kind == "duplicate":
            text = text[:-1] + ',"__metadata__":{}}'
        elif kind == "nan":
            name = _tensor_names(header)[0]
            text = text.replace(f'"{name}":{{"dtype"', f'"{name}":{{"nan":NaN,"dtype"', 1)
        elif kind == "deep":
            text = text[:-1] + ',"deep":' + "[" * 100_000 + "]" * 100_000 + "}"
        elif kind == "utf8":
            raw = text.encode()[:-1] + b',"\xff\xfe":"x"}'
            return _signed(raw, data)
        elif kind == "not_object":
            text = "[" + text + "]"
        return _signed(text.encode(), data)

    return mutate


def _bool_two(value: bytes, rng: random.Random) -> bytes:
    header, data = _split(value)
    (n,) = _LEN.unpack_from(value, 0)
    # Append a BOOL tensor holding a 2, with a correct field checksum, and re-sign.
    begin = len(data)
    data = data + b"\x00\x02\x01"
    header["flags"] = {"dtype": "BOOL", "shape": [3], "data_offsets": [begin, begin + 3]}
    # format 2: the fields' checksums in data order, and this field's data comes last
    header["__metadata__"]["field_checksums"] += xxhash.xxh3_64_hexdigest(b"\x00\x02\x01")
    return _resign(header, data)


def _trailing(value: bytes, rng: random.Random) -> bytes:
    return value + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))


def _families(canary_dir: Path) -> dict[str, Mutator]:
    def pickled(how: str, where: str) -> Mutator:
        def mutate(value: bytes, rng: random.Random) -> bytes:
            payload = _pickle_payload(canary_dir / f"canary-{how}-{where}", how)
            if where == "whole":
                return payload
            if where == "as_header":
                return _LEN.pack(len(payload)) + payload
            if where == "appended":
                return value + payload
            header, data = _split(value)  # "in_data": over a tensor's bytes
            info = header["octree"]["data_offsets"]
            body = payload.ljust(info[1] - info[0], b".")[: info[1] - info[0]]
            return _resign(header, data[: info[0]] + body + data[info[1] :])

        return mutate

    return {
        "flip_any_bit": _flip,
        "flip_data_bit": _flip_data,
        "truncate": _truncate,
        "header_len_2^63": _length(2**63),
        "header_len_2^64-1": _length(2**64 - 1),
        "header_len_past_end": _length(None),
        "header_len_200MiB": _length(200 << 20),
        "shape_x_dtype_mismatch": _edit(_shape),
        "dtype_mismatch": _edit(_dtype),
        "overlapping_offsets": _edit(_overlap),
        "same_offsets": _edit(_same_offsets),
        "offsets_out_of_range": _edit(_out_of_range),
        "bad_header_values": _edit(_bad_value),
        "format_version": _edit(_version),
        "metadata_not_str": _edit(_metadata_type),
        "duplicate_keys": _raw_header("duplicate"),
        "nan_in_header": _raw_header("nan"),
        "deep_nesting": _raw_header("deep"),
        "non_utf8_header": _raw_header("utf8"),
        "header_not_object": _raw_header("not_object"),
        "bool_byte_2": _bool_two,
        "trailing_bytes": _trailing,
        "pickle_whole": pickled("open", "whole"),
        "pickle_as_header": pickled("system", "as_header"),
        "pickle_appended": pickled("open", "appended"),
        "pickle_in_data": pickled("system", "in_data"),
    }


def _huge_header(value: bytes) -> bytes:
    """A header past the 100 MiB bound, really that long (built once, not stored)."""
    header, data = _split(value)
    text = json.dumps(header, separators=(",", ":")).encode()
    return _signed(text + b" " * ((100 << 20) + 64), data)


# --------------------------------------------------------------------------- the test


def _rejects(
    fn: Callable[[], object],
    key: str,
    outcomes: Counter,
    surface: str,
    intact: Callable[[object], bool] | None = None,
) -> None:
    """Count how ``fn`` treated the mutant under ``key``. Subset reads (``intact``) only
    verify the bytes they return: one that returns them unaltered is counted as such."""
    try:
        result = fn()
    except CorruptRecord as exc:
        named = exc.key == key and key in str(exc)
        outcomes[f"{surface}: rejected, key named" if named else f"{surface}: key NOT named"] += 1
    except Exception as exc:  # noqa: BLE001 - any other exception is a finding, counted
        outcomes[f"{surface}: CRASH {type(exc).__name__}: {str(exc)[:300]}"] += 1
    else:
        if intact is not None and intact(result):
            outcomes[f"{surface}: subset returned unaltered"] += 1
        else:
            outcomes[f"{surface}: ACCEPTED"] += 1


def _octree_of(value: bytes) -> bytes:
    return bytes(decode_arrays(value, fields=["octree"])[0]["octree"].tobytes())


_FINE = ("rejected, key named", "subset returned unaltered")


@pytest.mark.slow
def test_mutated_records_are_all_rejected_with_their_key(tmp_path: Path) -> None:
    canaries = tmp_path / "canaries"
    canaries.mkdir()
    families = _families(canaries)
    names = sorted(families)
    rng = random.Random(20261121)
    fp = fingerprint_of("spc", level=4)
    mutants: dict[str, tuple[str, bytes]] = {}
    bases: dict[str, bytes] = {}
    for i in range(MUTANTS):
        family = names[i % len(names)]
        key = f"{fp}/m{i:04d}"
        bases[key] = make_record(fp, f"m{i:04d}", seed=i, num_points=rng.randint(5, 60))
        mutants[key] = (family, families[family](bases[key], rng))

    outcomes: Counter[str] = Counter()
    for key, (family, value) in mutants.items():
        octree = _octree_of(bases[key])
        # each callable runs at once, inside _rejects; the defaults bind this iteration's values
        _rejects(lambda v=value, k=key: decode_record(v, key=k), key, outcomes, "decode_record")
        _rejects(lambda v=value, k=key: decode_arrays(v, key=k), key, outcomes, "decode_arrays")
        _rejects(
            lambda v=value, k=key: select_fields(v, ["octree"], key=k),
            key,
            outcomes,
            "select_fields",
            lambda out, want=octree: _octree_of(out) == want,
        )
    huge_key = f"{fp}/huge"
    huge = _huge_header(make_record(fp, "huge", seed=1))
    _rejects(lambda v=huge: decode_record(v, key=huge_key), huge_key, outcomes, "decode_record")
    del huge

    # Stored raw (past put_many's checks, as a disk fault or a foreign writer would).
    cache = tmp_path / "cache"
    LMDBStore(cache, readonly=False).open().close()
    env = lmdb.open(str(cache / "records"), max_dbs=4, map_size=1 << 30)
    with env.begin(write=True) as txn:
        db = env.open_db(b"records", txn=txn)
        for key, (_, value) in mutants.items():
            txn.put(key.encode(), value, db=db)
        # the descriptor every base record names, stored as a writer stores it: a
        # mutant is refused for what was done to it, not for a missing descriptor
        shared = next(iter(bases.values())).descriptor
        txn.put(
            f"{fp}/{shared.digest}".encode(),
            shared.text.encode(),
            db=env.open_db(b"descriptors", txn=txn),
        )
    env.close()
    with LMDBStore(cache) as store:
        for key in mutants:
            _rejects(lambda k=key: store.get_record(k), key, outcomes, "LMDBStore.get_record")
        verified = store.verify()

    settings = Settings(cache=cache, source_roots=[tmp_path], token=TOKEN, worker=False)
    server_errors: Counter[str] = Counter()
    with served(settings) as server, httpx.Client(base_url=server.url, timeout=30) as raw:
        client = HTTPStore(server.url, retries=0)
        for key in mutants:
            _rejects(lambda k=key: client.get_record(k), key, outcomes, "HTTP GET")
            _rejects(
                lambda k=key: client.get_record(k, fields=["octree"]),
                key,
                outcomes,
                "HTTP GET fields",
                lambda rec, base=bases[key]: (
                    rec.tensors["octree"].numpy().tobytes() == _octree_of(base)
                ),
            )
            _rejects(lambda k=key: client.get_records([k]), key, outcomes, "HTTP batch")
            sid = key.split("/", 1)[1]
            response = raw.get(f"/v1/caches/{fp}/records/{sid}", params={"fields": "octree"})
            if response.status_code >= 500:
                body = response.json()
                ok = body.get("error") in (
                    "CorruptRecord",
                    "UnsupportedFormat",
                ) and key in body.get("detail", "")
                server_errors["corrupt record named" if ok else f"other {body}"] += 1
        client.close()
        alive = raw.get("/healthz").status_code

    canary_files = sorted(p.name for p in canaries.iterdir())
    rejected = sum(n for k, n in outcomes.items() if k.endswith(_FINE[0]))
    subset_ok = sum(n for k, n in outcomes.items() if k.endswith(_FINE[1]))
    failures = {k: n for k, n in outcomes.items() if not k.endswith(_FINE)}
    figures = {
        "mutants": MUTANTS + 1,
        "families": len(names),
        "surface_checks": sum(outcomes.values()),
        "rejected_with_key": rejected,
        "subset_reads_returning_unaltered_fields": subset_ok,
        "not_rejected_or_crashed": failures,
        "verify_corrupt": len(verified.corrupt),
        "server_5xx_answers": dict(server_errors),
        "canary_files": canary_files,
        "service_alive_after": alive == 200,
    }
    report("7 hostile records", figures)
    assert not failures, failures
    full_reads = MUTANTS * 5 + 1  # decode_record, decode_arrays, get_record, GET, batch
    assert rejected + subset_ok == MUTANTS * 7 + 1 and rejected >= full_reads
    assert len(verified.corrupt) == MUTANTS and verified.checked == MUTANTS
    assert set(server_errors) <= {"corrupt record named"}, server_errors
    assert not canary_files and alive == 200
