"""A collated batch as ``kaolin.rep.Spc``: on the CPU, the fields handed to Kaolin equal
those Kaolin's Spc would compute from the same octrees (scan_octrees, generate_points:
our ops, and Kaolin's published expectations); on CUDA with Kaolin, the Spc itself."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cache_store import CachedDataset, collate_spc
from cache_store.errors import ParameterError
from cache_store.readers.to_kaolin import spc_fields, to_kaolin_spc
from cache_store.format.index import DatasetIndex
from cache_store.stores.lmdb import LMDBStore
from tests.helpers.kaolin_data import (
    TWO_OCTREES_EXSUM,
    TWO_OCTREES_POINTS,
    TWO_OCTREES_PYRAMIDS,
    two_octrees,
)
from tests.helpers.synthetic import fingerprint_of, make_record
from workers.ops import torch_spc

FP = fingerprint_of("spc", level=5)


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("kaolin")
    ids = [f"s{i}" for i in range(6)]
    with LMDBStore(path, readonly=False) as store:
        store.put_many(
            (f"{FP}/{sid}", make_record(FP, sid, seed=i, level=5, num_points=30 + 9 * i))
            for i, sid in enumerate(ids)
        )
        store.put_index(
            DatasetIndex(FP, "spc", 1, {"level": 5, "surface_samples": 100_000}, np.array(ids))
        )
    loader = DataLoader(CachedDataset(path, FP), batch_size=6, collate_fn=collate_spc)
    return next(iter(loader))


def test_fields_equal_what_kaolin_would_compute_from_the_octrees(batch: dict) -> None:
    fields = spc_fields(batch)
    max_level, pyramids, exsum = torch_spc.scan_octrees(fields["octrees"], fields["lengths"])
    assert fields["max_level"] == max_level == 5
    assert torch.equal(fields["pyramids"], pyramids) and fields["pyramids"].device.type == "cpu"
    assert torch.equal(fields["exsum"], exsum)
    assert torch.equal(
        fields["point_hierarchies"], torch_spc.generate_points(fields["octrees"], pyramids, exsum)
    )
    assert fields["octrees"].dtype == torch.uint8 and fields["lengths"].dtype == torch.int32
    assert fields["point_hierarchies"].dtype == torch.int16
    # the layout the released Kaolin 0.18.0 Spc asserts: num_bytes + batch_size
    legacy = spc_fields(batch, exsum_layout="legacy")["exsum"]
    with pytest.warns(DeprecationWarning):
        _, _, expected = torch_spc.scan_octrees(
            fields["octrees"], fields["lengths"], legacy_exsum=True
        )
    assert legacy.shape == (fields["octrees"].shape[0] + 6,) and torch.equal(legacy, expected)


def test_kaolins_published_two_octrees() -> None:
    octrees, lengths = two_octrees()
    samples = []
    for octree in torch.split(octrees, lengths.tolist()):
        one = torch.tensor([octree.shape[0]], dtype=torch.int32)
        _, pyramid, exsum = torch_spc.scan_octrees(octree, one)
        samples.append(
            {
                "octree": octree,
                "pyramid": pyramid[0],
                "exsum": exsum,
                "point_hierarchy": torch_spc.generate_points(octree, pyramid, exsum),
            }
        )
    fields = spc_fields(collate_spc(samples))
    assert fields["pyramids"].tolist() == TWO_OCTREES_PYRAMIDS
    assert fields["exsum"].tolist() == TWO_OCTREES_EXSUM
    assert fields["point_hierarchies"].tolist() == TWO_OCTREES_POINTS
    legacy = spc_fields(collate_spc(samples), exsum_layout="legacy")["exsum"].tolist()
    assert legacy == [0, *TWO_OCTREES_EXSUM[:6], 0, *TWO_OCTREES_EXSUM[6:]]


def test_a_batch_without_the_structures_is_refused(batch: dict) -> None:
    with pytest.raises(ParameterError, match="point_hierarchy"):
        spc_fields({k: v for k, v in batch.items() if k != "point_hierarchy"})
    with pytest.raises(ParameterError, match="exsum_layout"):
        spc_fields(batch, exsum_layout="inclusive")
    if importlib.util.find_spec("kaolin") is None:  # without Kaolin: a plain ImportError
        with pytest.raises(ImportError, match="kaolin"):
            to_kaolin_spc(batch, "cpu")


@pytest.mark.gpu
def test_kaolin_spc_takes_the_records_structures(batch: dict) -> None:
    # not importorskip: on a broken Kaolin it warns, an error under filterwarnings = error
    from cache_store.errors import BackendUnavailable
    from workers.ops.kaolin_spc import ensure_available

    try:
        ensure_available()  # Kaolin 0.18 imports (noisy or not) and CUDA works
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    from kaolin.rep import Spc

    spc = to_kaolin_spc(batch, "cuda")
    assert spc._pyramids is not None and spc._exsum is not None  # handed over, not computed
    reference = Spc(batch["octree"].cuda(), batch["lengths"].to(torch.int32))  # Kaolin computes
    assert spc.max_level == reference.max_level
    assert torch.equal(spc.pyramids, reference.pyramids)
    assert torch.equal(spc.exsum, reference.exsum)
    assert torch.equal(spc.point_hierarchies, reference.point_hierarchies)
    assert spc.batch_size == 6
