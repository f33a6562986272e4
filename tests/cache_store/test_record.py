from __future__ import annotations

import itertools
import json
import struct

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_store.errors import CorruptRecord, ParameterError, UnknownName, UnsupportedFormat
from cache_store.format.decode import check_record, decode_arrays, decode_record, decode_records
from cache_store.format.encode import encode_record, encode_tensors, select_fields
from cache_store.format.descriptor import DESCRIPTOR_METADATA, bind_metadata
from cache_store.format.header import DTYPES, read_header, read_metadata, record_checksum
from tests.helpers.synthetic import record_metadata, spc_query_fields
from cache_store.testing.format1 import encode_record_v1

FP = "0123456789abcdef" * 2
KEY = f"{FP}/chairs/a1"


def _meta() -> dict[str, str]:
    return record_metadata(FP, "chairs/a1", "spc_query")


def _record(seed: int = 0) -> tuple[dict[str, torch.Tensor], bytes]:
    fields = spc_query_fields(seed)
    return fields, encode_record(fields, _meta())


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


def test_round_trip_of_recipe_fields_and_metadata() -> None:
    fields, value = _record()
    rec = decode_record(value, key=KEY)
    _assert_same(rec.tensors, fields)
    # the record holds what is its own; what the fingerprint's records share is in its
    # descriptor, which the record names and carries to the store that keeps it
    assert rec.metadata["format_version"] == "2"
    assert rec.metadata["descriptor"] == value.descriptor.digest
    for k, v in _meta().items():
        assert (value.descriptor.metadata if k in DESCRIPTOR_METADATA else rec.metadata)[k] == v
        assert (k in rec.metadata) == (k not in DESCRIPTOR_METADATA)
    merged = bind_metadata(rec.metadata, KEY, lambda fp, digest: value.descriptor)
    for k, v in _meta().items():
        assert merged[k] == v
    assert merged["created"] and merged["spcache_version"]
    assert rec.checksum == record_checksum(value) == read_metadata(value)["checksum"]


def test_a_record_header_is_small_and_its_descriptor_is_shared() -> None:
    fields, value = _record()
    n = struct.unpack("<Q", value[:8])[0]
    old = encode_record_v1(fields, _meta())
    assert n < struct.unpack("<Q", old[:8])[0]
    for moved in DESCRIPTOR_METADATA:  # in the descriptor, not in the record
        assert f'"{moved}":'.encode() not in value[: 8 + n]
    _, other = _record(seed=5)
    assert other.descriptor is value.descriptor  # one per run, not one per record


@pytest.mark.parametrize("dtype", [getattr(torch, n) for n in DTYPES.values()], ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 2), (5, 3)], ids=str)
def test_round_trip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(
        0,
        256,
        (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=g,
    )
    t = raw.view(dtype).reshape(shape) if dtype != torch.bool else (raw % 2).bool().reshape(shape)
    rec = decode_record(encode_tensors({"t": t, "pad": torch.ones(3, dtype=torch.uint8)}))
    out = rec.tensors["t"]
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    out.reshape(-1).view(torch.uint8).fill_(0)  # each decoded tensor owns writable memory


def test_numpy_round_trip_without_torch_dtypes() -> None:
    from cache_store.format.decode import decode_arrays

    arrays = {
        "be": np.arange(6, dtype=">i4").reshape(2, 3),
        "b": np.array([True, False]),
        "f": np.linspace(0, 1, 5, dtype=np.float16),
    }
    value = encode_tensors(arrays, {"m": "x"})
    out, meta = decode_arrays(value, fields=["be", "b", "f"])
    assert meta["m"] == "x"
    for name, array in arrays.items():
        assert np.array_equal(out[name], array) and out[name].dtype.isnative
    assert torch.equal(
        decode_record(value).tensors["be"], torch.arange(6, dtype=torch.int32).reshape(2, 3)
    )


def test_numpy_inputs_and_non_contiguous_tensors() -> None:
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    rec = decode_record(encode_tensors({"a": np.arange(5, dtype=np.float64), "t": t}))
    assert torch.equal(rec.tensors["t"], t)
    assert torch.equal(rec.tensors["a"], torch.arange(5, dtype=torch.float64))


def test_any_safetensors_reader_opens_a_record() -> None:
    fields, value = _record()
    loaded = safetensors.torch.load(value)
    _assert_same(loaded, fields)
    as_numpy = safetensors.numpy.load(value)
    assert np.array_equal(as_numpy["point_hierarchy"], fields["point_hierarchy"].numpy())
    # and the other way: a record built by the reference writer, plus our metadata, decodes
    n = struct.unpack("<Q", value[:8])[0]
    assert (8 + n) % 8 == 0  # data section aligned


def test_buffers_are_aligned_for_their_dtype() -> None:
    _, value = _record()
    header = read_header(value)
    from cache_store.format.header import ITEMSIZE

    for info in header.tensors.values():
        assert info.begin % ITEMSIZE[info.dtype] == 0


def test_subset_decoding_touches_only_its_fields() -> None:
    fields, value = _record()
    header = read_header(value)
    info = header.tensors["query_points"]
    broken = bytearray(value)
    broken[info.begin] ^= 0xFF  # corrupt a field we do not ask for
    rec = decode_record(bytes(broken), key=KEY, fields=["octree", "exsum"])
    assert set(rec.tensors) == {"octree", "exsum"}
    assert torch.equal(rec.tensors["octree"], fields["octree"])
    with pytest.raises(CorruptRecord, match="query_points"):
        decode_record(bytes(broken), key=KEY)
    with pytest.raises(UnknownName):
        decode_record(value, fields=["nope"])


def test_select_fields_re_encodes_a_verifiable_subset() -> None:
    fields, value = _record()
    sub = select_fields(value, ["pyramid", "octree"], key=KEY)
    rec = decode_record(sub)
    assert set(rec.tensors) == {"pyramid", "octree"}
    assert torch.equal(rec.tensors["pyramid"], fields["pyramid"])
    assert rec.metadata["sample_id"] == "chairs/a1"
    assert rec.checksum != record_checksum(value)
    assert select_fields(value, ["octree", "pyramid"]) == sub  # order-independent, deterministic
    assert safetensors.torch.load(sub).keys() == {"pyramid", "octree"}


def test_checksum_changes_with_metadata_and_data() -> None:
    fields = spc_query_fields(0)
    a = encode_record(fields, {**_meta(), "created": "t0"})
    b = encode_record(fields, {**_meta(), "created": "t1"})
    fields["occupancy"][0] ^= 1
    c = encode_record(fields, {**_meta(), "created": "t0"})
    assert len({record_checksum(a), record_checksum(b), record_checksum(c)}) == 3
    assert encode_record(spc_query_fields(0), {**_meta(), "created": "t0"}) == a


def test_every_flipped_bit_is_caught() -> None:
    _, value = _record()
    value = value[:]  # bytes
    rng = np.random.default_rng(0)
    positions = list(range(0, len(value), 7)) + list(rng.integers(0, len(value), 300))
    for pos in positions:
        for bit in (0, 5):
            broken = bytearray(value)
            broken[pos] ^= 1 << bit
            with pytest.raises(CorruptRecord) as err:
                decode_record(bytes(broken), key=KEY)
            assert KEY in str(err.value)


def test_every_truncation_is_caught() -> None:
    _, value = _record()
    for cut in list(range(64)) + list(range(64, len(value), 13)):
        with pytest.raises(CorruptRecord, match="corrupt record"):
            decode_record(value[:cut], key=KEY)
    with pytest.raises(CorruptRecord):
        decode_record(value + b"\0", key=KEY)


def _rewrite_header(value: bytes, edit, sign: bool = False) -> bytes:
    from cache_store.format.header import sign_header

    n = struct.unpack("<Q", value[:8])[0]
    header = json.loads(value[8 : 8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text = sign_header(text) if sign else text
    return struct.pack("<Q", len(text)) + text + value[8 + n :]


def test_unknown_format_version_is_unsupported() -> None:
    _, value = _record()
    newer = _rewrite_header(value, lambda h: h["__metadata__"].update(format_version="3"))
    with pytest.raises(UnsupportedFormat, match="format_version '3'") as err:
        decode_record(newer, key=KEY)
    assert isinstance(err.value, CorruptRecord) and KEY in str(err.value)
    missing = _rewrite_header(value, lambda h: h["__metadata__"].pop("format_version"))
    with pytest.raises(UnsupportedFormat):
        read_metadata(missing)


def test_crafted_headers_with_valid_checksums_are_still_checked() -> None:
    """A header edited *and* re-checksummed must still be refused when it lies."""
    _, value = _record()

    def resign(edit):
        return _rewrite_header(value, edit, sign=True)

    cases = {
        "overlap": lambda h: h["octree"].update(
            data_offsets=[0, h["octree"]["data_offsets"][1] - h["octree"]["data_offsets"][0]]
        ),
        "shape": lambda h: h["octree"].update(shape=[h["octree"]["shape"][0] + 1]),
        "dtype": lambda h: h["octree"].update(dtype="Q9"),
        "bool-shape": lambda h: h["octree"].update(shape=[True]),
        "extra": lambda h: h.update(ghost={"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}),
        "meta-type": lambda h: h["__metadata__"].update(sample_id=3),
        "checksums-short": lambda h: h["__metadata__"].update(
            field_checksums=h["__metadata__"]["field_checksums"][:-1]
        ),
        "entry-keys": lambda h: h["octree"].update(extra=1),
        "negative": lambda h: h["octree"].update(data_offsets=[-1, 3]),
        "nested": lambda h: h["__metadata__"].update(field_checksums="[" * 100_000),
        "huge-dim": lambda h: h["octree"].update(shape=[10**30]),
    }
    for name, edit in cases.items():
        with pytest.raises(CorruptRecord) as err:
            decode_record(resign(edit), key=name)
        assert "checksum mismatch" not in err.value.reason, (name, err.value.reason)
    bool_value = encode_tensors({"b": torch.tensor([True, False])})
    n = struct.unpack("<Q", bool_value[:8])[0]
    bad = bytearray(bool_value)
    bad[8 + n] = 2
    import xxhash

    hacked = _rewrite_header(
        bytes(bad),
        lambda h: h["__metadata__"].update(
            field_checksums=xxhash.xxh3_64_hexdigest(bytes(bad[8 + n :]))
        ),
        sign=True,
    )
    with pytest.raises(CorruptRecord, match="BOOL"):
        decode_record(hacked)
    for check in (
        lambda value: check_record(value, key="k", lookup=lambda fp, digest: None),
        lambda value: select_fields(value, ["b"]),
        lambda value: decode_arrays(value),
    ):  # every reader refuses it alike
        with pytest.raises(CorruptRecord, match="BOOL"):
            check(hacked)
    for name, edit in cases.items():  # and check_record (verify) refuses what decode does
        with pytest.raises(CorruptRecord):
            check_record(resign(edit), key=name, lookup=lambda fp, digest: value.descriptor)


def test_header_checksum_covers_every_header_byte() -> None:
    _, value = _record()
    n = struct.unpack("<Q", value[:8])[0]
    for pos in range(8, 8 + n):
        broken = bytearray(value)
        broken[pos] = ord(" ") if broken[pos] != ord(" ") else ord("\t")
        with pytest.raises(CorruptRecord):
            read_header(bytes(broken))


def test_duplicate_header_keys_are_refused() -> None:
    _, value = _record()
    n = struct.unpack("<Q", value[:8])[0]
    text = value[8 : 8 + n].rstrip()
    dup = text[:-1] + b',"__metadata__":{}}'
    with pytest.raises(CorruptRecord, match="duplicate"):
        decode_record(struct.pack("<Q", len(dup)) + dup + value[8 + n :])


def _signed_with_text_edit(value: bytes, old: bytes, new: bytes) -> bytes:
    from cache_store.format.header import sign_header

    n = struct.unpack("<Q", value[:8])[0]
    text = value[8 : 8 + n].rstrip()
    assert text.count(old) == 1
    text = sign_header(text.replace(old, new))
    return struct.pack("<Q", len(text)) + text + value[8 + n :]


@pytest.mark.parametrize("where", ["tensor-entry", "metadata", "field-checksums", "top-level"])
def test_duplicate_keys_are_refused_at_every_level_even_when_signed(where: str) -> None:
    """A writer that re-signs a header with a duplicated key must not get one meaning
    for this reader and another for a first-key-wins reader (format 1 records too, whose
    field checksums are JSON inside the header's JSON)."""
    fields, value = _record()
    if where == "field-checksums":
        value = encode_record_v1(fields, _meta())
    header = read_header(value)
    octree = header.tensors["octree"]
    begin = octree.begin - header.data_start
    edits = {
        "tensor-entry": (b'"octree":{"dtype":"U8"', b'"octree":{"dtype":"I8","dtype":"U8"'),
        "metadata": (b'"sample_id":', b'"sample_id":"other","sample_id":'),
        "field-checksums": (b'{\\"', b'{\\"octree\\":\\"0\\",\\"'),
        "top-level": (
            b'"octree":{',
            b'"octree":{"dtype":"U8","shape":[0],"data_offsets":['
            + str(begin).encode()
            + b","
            + str(begin).encode()
            + b']},"octree":{',
        ),
    }
    hacked = _signed_with_text_edit(value, *edits[where])
    with pytest.raises(CorruptRecord, match="duplicate") as err:
        decode_record(hacked, key=KEY)
    assert KEY in str(err.value)


def test_decoded_bytes_are_the_verified_bytes() -> None:
    """Decoding copies each field and verifies the copy: what comes back matches the
    stored checksum, owns its memory and is writable without touching the input."""
    tensors, value = _record()
    source = bytearray(value)
    rec = decode_record(source, key=KEY)
    _assert_same(rec.tensors, tensors)
    for name, tensor in rec.tensors.items():
        if tensor.numel():
            tensor.view(-1)[0] = tensor.view(-1)[0] + 1 if tensor.dtype != torch.bool else True
    assert bytes(source) == value
    header = read_header(value)
    for name in header.tensors:
        info = header.tensors[name]
        assert info.end - info.begin == tensors[name].numel() * tensors[name].element_size()


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"\x00" * 8,
        b"\xff" * 16,
        b"{}",
        12,
        None,
        "text",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 2) + b"{}",
        struct.pack("<Q", 4) + b"\xff\xfe{}",
    ],
)
def test_garbage_is_corrupt(value: object) -> None:
    with pytest.raises(CorruptRecord):
        decode_record(value, key="k")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutations_raise_only_corrupt_record(data: st.DataObject) -> None:
    _, value = _record(1)
    buf = bytearray(value)
    n_edits = data.draw(st.integers(1, 6))
    for _ in range(n_edits):
        kind = data.draw(st.sampled_from(["flip", "set", "cut", "insert", "header"]))
        if kind == "flip" and buf:
            i = data.draw(st.integers(0, len(buf) - 1))
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set" and buf:
            i = data.draw(st.integers(0, len(buf) - 1))
            buf[i] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            buf = buf[: data.draw(st.integers(0, len(buf)))]
        elif kind == "insert":
            i = data.draw(st.integers(0, len(buf)))
            buf[i:i] = data.draw(st.binary(max_size=16))
        else:
            buf[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    try:
        rec = decode_record(bytes(buf), key="fuzz")
    except CorruptRecord as err:
        assert "fuzz" in str(err)
    else:  # only a no-op edit may decode, and then it must be the original
        assert bytes(buf) == value
        assert rec.metadata["sample_id"] == "chairs/a1"


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(value: bytes) -> None:
    with pytest.raises(CorruptRecord):
        decode_record(value, key="r")


def test_encoding_refuses_bad_inputs() -> None:
    fields = spc_query_fields(0)
    with pytest.raises(ParameterError, match="source_hash"):
        encode_record(fields, {k: v for k, v in _meta().items() if k != "source_hash"})
    with pytest.raises(ParameterError, match="checksum"):
        encode_record(fields, {**_meta(), "checksum": "x"})
    with pytest.raises(ParameterError, match="str"):
        encode_record(fields, {**_meta(), "level": 8})
    with pytest.raises(ParameterError, match="dense real"):
        encode_tensors({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ParameterError):
        encode_tensors({"__metadata__": torch.zeros(2)})
    with pytest.raises(ParameterError):
        encode_tensors({"o": np.array(["a"], dtype=object)})
    with pytest.raises(ParameterError):
        encode_tensors({"l": [1, 2]})


# ------------------------------------------------------------- one storage per read


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_a_record_shares_one_buffer_and_keeps_header_order() -> None:
    fields, value = _record(3)
    rec = decode_record(value, key=KEY)
    _assert_same(rec.tensors, fields)
    # one buffer (outside a worker: a storage per field over it, cheaper to build)
    ptrs = sorted(t.data_ptr() for t in rec.tensors.values() if t.numel())
    assert ptrs[-1] - ptrs[0] < len(value)
    assert list(rec.tensors) == list(read_header(value).tensors)  # header order kept
    for name, t in rec.tensors.items():
        assert t.is_contiguous() and t.data_ptr() % t.element_size() == 0, name
    # writable and independent of the input bytes
    rec["octree"][0] = 0
    assert decode_record(value, key=KEY)["octree"][0] == fields["octree"][0]


def test_fields_in_any_order_and_subsets_with_gaps_decode_exactly() -> None:
    """A record's fields are copied in runs of neighbours; any order or subset of fields
    must still give each field's own bytes, aligned, in the order asked for."""
    fields, value = _record(5)
    stored = list(read_header(value).tensors)
    for chosen in (stored[::-1], stored[::2], stored[1::3] + stored[:1], [stored[-1]]):
        for rec in (
            decode_record(value, key=KEY, fields=chosen),
            decode_records([(KEY, value)], fields=chosen)[0],
        ):
            assert list(rec.tensors) == chosen
            _assert_same(rec.tensors, {n: fields[n] for n in chosen})
            for name, t in rec.tensors.items():
                assert t.data_ptr() % t.element_size() == 0, name


def test_a_foreign_layout_with_unaligned_and_unordered_fields_decodes() -> None:
    """Another writer may put a 1-byte field before a 4-byte one (so the second lies
    unaligned in the data section) and list its header entries out of data order."""
    import xxhash

    from cache_store.format.header import sign_header

    small = np.arange(3, dtype=np.uint8)
    wide = np.array([1.5, -2.25, 3.0], dtype=np.float32)
    half = np.array([7, -8], dtype=np.int16)
    data = small.tobytes() + wide.tobytes() + half.tobytes()
    meta = dict(
        record_metadata(FP, "chairs/a1", "spc_query"),
        format_version="1",
        field_checksums=json.dumps(
            {
                "half": xxhash.xxh3_64_hexdigest(half.tobytes()),
                "small": xxhash.xxh3_64_hexdigest(small.tobytes()),
                "wide": xxhash.xxh3_64_hexdigest(wide.tobytes()),
            },
            sort_keys=True,
            separators=(",", ":"),
        ),
        checksum="0" * 32,
    )
    header = {
        "__metadata__": meta,
        "wide": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]},
        "half": {"dtype": "I16", "shape": [2], "data_offsets": [15, 19]},
        "small": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    value = struct.pack("<Q", len(text)) + sign_header(text) + data
    want = {
        "wide": torch.from_numpy(wide),
        "half": torch.from_numpy(half),
        "small": torch.from_numpy(small),
    }
    for rec in (
        decode_record(value, key=KEY),
        decode_records([(KEY, value)] * 2)[1],
        decode_record(value, key=KEY, fields=["small", "wide"]),
    ):
        _assert_same(rec.tensors, {n: want[n] for n in rec.tensors})
        for name, t in rec.tensors.items():
            assert t.data_ptr() % t.element_size() == 0, name
    flipped = bytearray(value)
    flipped[-5] ^= 1  # the last byte of ``wide``
    with pytest.raises(CorruptRecord, match="'wide'"):
        decode_record(bytes(flipped), key=KEY)


def test_a_batch_is_one_storage_laid_out_field_by_field() -> None:
    made = [_record(seed) for seed in range(4)]
    keys = [f"{FP}/k{seed}" for seed in range(4)]
    records = decode_records(
        zip(keys, [v for _, v in made], strict=True), fields=["octree", "exsum", "scale"]
    )
    assert len(_storages(t for r in records for t in r.tensors.values())) == 1
    for (fields, value), rec in zip(made, records, strict=True):
        _assert_same(rec.tensors, {n: fields[n] for n in ("octree", "exsum", "scale")})
        assert rec.metadata == decode_record(value).metadata
    # each field's tensors end to end, in batch order
    for name in ("octree", "exsum", "scale"):
        ts = [r[name] for r in records]
        for a, b in itertools.pairwise(ts):
            assert a.data_ptr() + a.nbytes == b.data_ptr(), name


def test_a_bad_record_in_a_batch_is_named() -> None:
    good = [_record(seed)[1] for seed in range(3)]
    bad = bytearray(good[1])
    bad[-1] ^= 0xFF
    with pytest.raises(CorruptRecord, match=f"{FP}/second") as info:
        decode_records(
            [(f"{FP}/first", good[0]), (f"{FP}/second", bytes(bad)), (f"{FP}/third", good[2])]
        )
    assert "checksum mismatch" in str(info.value)
    with pytest.raises(UnknownName):
        decode_records([(f"{FP}/first", good[0])], fields=["nope"])
    assert decode_records([]) == []


def test_batch_buffers_are_reused_only_once_released() -> None:
    made = [_record(seed) for seed in range(3)]
    items = [(f"{FP}/k{i}", v) for i, (_, v) in enumerate(made)]
    held = decode_records(items)
    held_ptr = held[0]["octree"].untyped_storage().data_ptr()
    kept_view = held[2]["point_hierarchy"][1:]  # a view alone keeps the buffer too
    del held
    for _ in range(5):  # later batches never write into memory a caller still sees
        again = decode_records(items)
        assert again[0]["octree"].untyped_storage().data_ptr() != held_ptr
        del again
    assert torch.equal(kept_view, made[2][0]["point_hierarchy"][1:])
    del kept_view
    # released: later batches of the same size take memory the pool already holds
    from cache_store.format.buffers import BATCH_BUFFERS

    pooled = {buf.ctypes.data for buf in BATCH_BUFFERS.buffers}
    ptrs = set()
    for _ in range(4):
        batch = decode_records(items)
        ptrs.add(batch[0]["octree"].untyped_storage().data_ptr())
        for (fields, _), rec in zip(made, batch, strict=True):
            _assert_same(rec.tensors, fields)
        del batch, rec
    assert ptrs <= pooled


def test_a_batch_a_few_per_cent_larger_takes_an_idle_buffer() -> None:
    """Batches of other records differ in size by a few per cent: one larger than every
    idle buffer took fresh pages (6-7 ms for 10 MB on the 2-core VM) about once an epoch.
    A new buffer has room to spare for them; one twice the batch is not taken."""
    from cache_store.format.buffers import SLACK, BufferPool

    pool = BufferPool()
    first = pool.take(10 << 20)
    where = first.ctypes.data
    del first
    larger = pool.take((10 << 20) + (10 << 20) // (2 * SLACK))
    assert larger.ctypes.data == where and larger.size == (10 << 20) + (10 << 20) // (2 * SLACK)
    del larger
    assert pool.take(20 << 20).ctypes.data != where  # past the slack: a buffer of its own


def test_headers_this_package_writes_take_the_fast_parser(monkeypatch) -> None:
    # the speed-up is real only if our own records are in orjson's canonical form
    from cache_store.format import header as record

    if record.FAST_JSON is None:
        pytest.fail("orjson is a listed dependency; its fast path is what is under test")
    strict = []
    real = record.STRICT_DECODER.decode
    monkeypatch.setattr(
        record,
        "STRICT_DECODER",
        type("Spy", (), {"decode": staticmethod(lambda text: strict.append(text) or real(text))})(),
    )
    tensors, value = _record()
    _assert_same(decode_record(value, key=KEY).tensors, tensors)
    assert strict == []


@pytest.mark.parametrize(
    "edit",
    [
        (b'"sample_id":', b'"sample_id" :'),  # not compact: same meaning
        (b'"sample_id":"', b'"sample_id":"\\u0041'),  # an escape orjson writes otherwise
    ],
)
def test_headers_not_in_canonical_form_parse_as_the_strict_parser_does(edit) -> None:
    from cache_store.format import header as record

    _, value = _record()
    hacked = _signed_with_text_edit(value, *edit)
    fast = read_header(hacked, key=KEY)
    saved, record.FAST_JSON = record.FAST_JSON, None
    try:
        slow = read_header(hacked, key=KEY)
    finally:
        record.FAST_JSON = saved
    assert fast.metadata == slow.metadata and fast.tensors == slow.tensors
    assert fast.metadata["sample_id"].startswith("A") == (edit[1].endswith(b"0041"))
