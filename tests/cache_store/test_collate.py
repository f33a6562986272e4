from __future__ import annotations

import pytest
import torch

from cache_store.readers.collate import collate_spc
from cache_store.errors import ParameterError
from tests.helpers.synthetic import spc_fields, spc_query_fields


def _kaolin_example() -> list[dict[str, torch.Tensor]]:
    """Kaolin's published two-octree example (lengths [6, 5]), one record per octree."""
    octrees = [[0b00010001, 0b11, 1, 2, 4, 8], [1, 0b111, 16, 0xFF, 0x0F]]
    pyramids = [[[1, 2, 3, 3, 0], [0, 1, 3, 6, 9]], [[1, 1, 3, 13, 0], [0, 1, 2, 5, 18]]]
    exsums = [[2, 4, 5, 6, 7, 8], [1, 4, 5, 13, 17]]
    return [
        {
            "octree": torch.tensor(o, dtype=torch.uint8),
            "pyramid": torch.tensor(p, dtype=torch.int32),
            "exsum": torch.tensor(e, dtype=torch.int32),
        }
        for o, p, e in zip(octrees, pyramids, exsums, strict=True)
    ]


def test_matches_kaolins_packed_layout() -> None:
    batch = collate_spc(_kaolin_example())
    assert batch["lengths"].tolist() == [6, 5] and batch["lengths"].dtype == torch.int32
    assert batch["octree"].shape == (11,) and batch["octree"][0].item() == 0b00010001
    assert batch["pyramid"].shape == (2, 2, 5)
    assert batch["pyramid"].tolist() == [
        [[1, 2, 3, 3, 0], [0, 1, 3, 6, 9]],
        [[1, 1, 3, 13, 0], [0, 1, 2, 5, 18]],
    ]
    assert batch["exsum"].tolist() == [2, 4, 5, 6, 7, 8, 1, 4, 5, 13, 17]


def test_spc_query_batch_shapes() -> None:
    samples = [spc_query_fields(seed, num_points=10 + 7 * seed) for seed in range(3)]
    batch = collate_spc(samples)
    assert batch["lengths"].tolist() == [s["octree"].shape[0] for s in samples]
    assert torch.equal(batch["octree"], torch.cat([s["octree"] for s in samples]))
    assert torch.equal(batch["point_hierarchy"], torch.cat([s["point_hierarchy"] for s in samples]))
    assert batch["pyramid"].shape == (3, 2, 6)
    assert batch["center"].shape == (3, 3) and batch["scale"].shape == (3,)
    assert batch["query_points"].shape == (3, 64, 3) and batch["query_pidx"].shape == (3, 64, 5)
    # the pyramids locate each octree's points inside the concatenated hierarchy
    totals = batch["pyramid"][:, 1, -1]
    assert int(totals.sum()) == batch["point_hierarchy"].shape[0]


def test_other_fields_of_varying_size_are_concatenated_with_lengths() -> None:
    samples = [dict(spc_fields(seed), labels=torch.arange(seed + 2)) for seed in range(3)]
    batch = collate_spc(samples)
    assert batch["labels"].tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 3]
    assert batch["labels_lengths"].tolist() == [2, 3, 4]


def test_non_tensor_values_use_default_collate() -> None:
    samples = [dict(spc_fields(seed), name=f"s{seed}", weight=0.5) for seed in range(2)]
    batch = collate_spc(samples)
    assert batch["name"] == ["s0", "s1"]
    assert batch["weight"].tolist() == [0.5, 0.5]


def test_clear_errors() -> None:
    with pytest.raises(ParameterError, match="empty"):
        collate_spc([])
    with pytest.raises(ParameterError, match="levels"):
        collate_spc([spc_fields(0, level=3), spc_fields(1, level=4)])
    with pytest.raises(ParameterError, match="fields"):
        collate_spc([spc_fields(0), {"octree": torch.zeros(1, dtype=torch.uint8)}])
    legacy = _kaolin_example()
    for s in legacy:  # the pre-0.18 exclusive layout has one more entry per octree
        s["exsum"] = torch.cat([torch.zeros(1, dtype=torch.int32), s["exsum"]])
    with pytest.raises(ParameterError, match="inclusive"):
        collate_spc(legacy)
    with pytest.raises(ParameterError, match="neither"):
        collate_spc([{"x": torch.zeros(2, 3)}, {"x": torch.zeros(2, 4)}])


def test_dtypes_survive_and_autograd_or_bfloat16_fall_back_to_torch() -> None:
    samples = [
        {
            "a": torch.arange(3, dtype=torch.int16),
            "b": torch.ones(2, dtype=torch.bfloat16),
            "c": torch.ones(2, requires_grad=True),
            "d": torch.tensor(True),
        }
        for _ in range(2)
    ]
    batch = collate_spc(samples)
    assert batch["a"].dtype == torch.int16 and batch["a"].shape == (2, 3)
    assert batch["b"].dtype == torch.bfloat16 and batch["c"].requires_grad
    assert batch["d"].dtype == torch.bool and batch["d"].tolist() == [True, True]


def test_fields_already_end_to_end_are_viewed_not_copied() -> None:
    from cache_store.format.decode import decode_records
    from cache_store.format.encode import encode_record
    from tests.helpers.synthetic import record_metadata

    fp = "0123456789abcdef" * 2
    samples = [spc_query_fields(seed, num_points=30 + 10 * seed) for seed in range(3)]
    values = [
        (f"{fp}/s{i}", encode_record(s, record_metadata(fp, f"s{i}", "spc_query")))
        for i, s in enumerate(samples)
    ]
    decoded = [r.tensors for r in decode_records(values)]
    viewed = collate_spc(decoded)
    copied = collate_spc(samples)  # separate tensors: copied as before
    assert viewed.keys() == copied.keys()
    storage = decoded[0]["octree"].untyped_storage().data_ptr()
    for name, want in copied.items():
        assert viewed[name].dtype == want.dtype and torch.equal(viewed[name], want), name
        if name not in ("lengths",):
            assert viewed[name].untyped_storage().data_ptr() == storage, name
    assert viewed["octree"].data_ptr() == decoded[0]["octree"].data_ptr()
    assert viewed["pyramid"].shape == (3, 2, 6)
    # a sample changed by a transform no longer lies end to end: copied, still right
    decoded[1]["exsum"] = decoded[1]["exsum"].clone()
    mixed = collate_spc(decoded)
    assert torch.equal(mixed["exsum"], copied["exsum"])
    assert mixed["exsum"].untyped_storage().data_ptr() != storage


def test_sample_ids_of_the_samples_kept() -> None:
    from cache_store.readers.collate import SpcSample

    samples = [SpcSample(spc_fields(seed), sample_id=f"s{seed}") for seed in range(3)]
    assert collate_spc([samples[0], None, samples[2]])["sample_ids"] == ["s0", "s2"]
    assert "sample_ids" not in collate_spc([spc_fields(0), spc_fields(1)])  # plain dicts
    named = [dict(spc_fields(s), sample_ids=torch.tensor([s])) for s in range(2)]
    assert collate_spc(named)["sample_ids"].tolist() == [[0], [1]]  # a field of that name wins
