"""CachedDataset: a fork-safe ``torch.utils.data.Dataset`` over one fingerprint of a cache.

What a forked DataLoader worker inherits from it is a handful of scalars and two NumPy
arrays (the sample ids as packed UTF-8 plus offsets): no per-sample Python objects whose
reference counts would copy pages on read, and no open store. Each process opens its
own store on first read; nothing here touches CUDA.

Why one module: CachedDataset's three read modes (a store, read-through, skip on error)
share its fork-safe state; each mode's machinery lives elsewhere
(readers/read_through.py and the two it chooses from, readers/skipped.py).
"""

from __future__ import annotations

import functools
import logging
import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch.utils.data

from cache_store import usage
from cache_store.errors import (
    CacheNotFound,
    ParameterError,
    RecordNotFound,
    SourceError,
    StaleRecord,
    one_line,
)
from cache_store.keys import compute_fingerprint, record_key
from cache_store.local_cache.spec import local_cache_option
from cache_store.process_local import ProcessLocal
from cache_store.recipes.api import Recipe
from cache_store.recipes.registry import (
    get_recipe_spec,
    installed_variable_fields,
    recipe_name_of,
    require_installed,
)
from cache_store.format.ids import pack_ids, unpack_ids
from cache_store.readers.collate import SpcSample
from cache_store.readers.read_through import read_through_client
from cache_store.readers.selection import resolve_index
from cache_store.readers.stale import staleness, wait_until_current
from cache_store.readers.skipped import (
    SKIPPABLE_ERRORS,
    SkippedSample,
    SkippedSamples,
)
from cache_store.readers.variants import VariantChoice, epoch_of, variant_problems
from cache_store.stores.base import BlockLayout, Store
from cache_store.stores.opener import open_store
from cache_store.views.hop import LocatedSample, hands_over, read_path, read_records
from cache_store.views.ring import ring_here
from cache_store.readers.options import checked_options

__all__ = ["CachedDataset"]

log = logging.getLogger(__name__)

Sample = dict[str, Any]


class CachedDataset(torch.utils.data.Dataset[dict[str, Any]]):
    """Records of one fingerprint of a cache, as dicts of CPU tensors, in index order.

    Args:
        cache: a cache directory, a ``.zarr`` path or URL, ``http(s)://host:port`` of the
            service, or an already constructed :class:`~cache_store.stores.base.Store`.
        fingerprint_or_recipe: a fingerprint, or a recipe name (``"spc_query"``; or a
            recipe class of this process, one ``spcache.recipe`` made) that,
            with ``**params``, selects exactly one dataset recorded in the cache: one of
            the installed recipe version whose parameters equal the given ones, a
            parameter left out matching any stored value (not its default). Several
            matches are no guess: ``FingerprintLookupError`` lists the candidates (see
            :func:`~cache_store.readers.selection.resolve_index`). With ``sources=``,
            defaults fill in instead.
        fields: names of the tensors to read (default: all; the others' bytes unread).
        transform: called on each sample dict (in the worker) before it is returned.
        store_options: passed to :func:`~cache_store.stores.opener.open_store` (e.g.
            ``max_readers`` for LMDB).
        sources: read-through (with a recipe name): a directory, ``.txt``/``.jsonl``
            manifest, file, or a list of them, discovered exactly as ``spcache
            precompute`` does (:func:`cache_store.sources.discover.discover_sources`). The
            samples are those sources, in that order, whatever the cache holds yet; the
            fingerprint is the recipe's with ``**params`` (defaults filled in).
        id_template: with sources, how sample ids are made from the files' relative
            paths (:func:`cache_store.sources.discover.sample_id_for`;
            ``spcache.KEEP_EXTENSION``, ``"{path}"``, keeps the extension), as ``spcache
            precompute --id-template`` makes them. Two sources with one id (``a.obj``
            beside ``a.ply``) stay two samples: the first keeps the id; reading a later
            one raises ``SourceError`` naming both files (with ``on_error="skip"`` it
            is skipped like any bad sample), as ``spcache precompute`` fails it.
        on_miss: ``"error"`` (raise ``RecordNotFound``; the default without sources) or
            ``"compute"`` (the default with sources): queue the sample for the cache's
            worker and wait for its record (see :mod:`cache_store.readers.queue_read_through`; over the
            service URL :mod:`cache_store.readers.http_read_through`: the service queues and
            waits, and the source paths must be visible to it inside its source roots).
        warm_ahead: on a miss, also queue this many following uncached samples (index
            order), so the worker keeps busy while loaders wait; a
            :class:`~cache_store.readers.sampler.Sampler` with ``read_ahead`` sets it
            to 0 and queues ahead in its own order instead.
        miss_timeout: seconds a miss waits for its record before ``MissTimeout``.
        on_error: ``"raise"`` (the default): a sample without a usable record raises.
            ``"skip"``: such a sample (no record, a damaged one, or one the worker could
            not compute: ``RecordNotFound``, ``CorruptRecord``, ``SampleFailed``) is
            returned as ``None``, which :func:`~cache_store.readers.collate.collate_spc`
            drops from its batch; it is logged once per sample id (whichever process
            skips it first) and listed by :attr:`failed`, in every process of the
            dataset, the parent after a DataLoader epoch included. Batches are then
            shorter than ``batch_size`` now and then, and a batch whose samples all
            failed collates to an empty dict (``if not batch: continue``).
        on_stale: with sources, what a stored record computed from other bytes than its
            source holds now is (the file was edited, or another directory's file has
            the same id): ``"compute"`` (the default with ``on_miss="compute"``) treats it
            as a miss, recomputed by the worker and waited for; ``"error"`` (the default
            with ``on_miss="error"``) raises ``StaleRecord``; ``"serve"`` returns it
            unchecked. Checked on every read of a sample, so every epoch and in every
            DataLoader worker process: one ``open`` + ``fstat`` of its source through the
            source gate (:mod:`cache_store.sources.files`), compared with the stat
            signature stored in the record; only when that differs is the source hashed
            (bounded by the gate), and an unchanged file is then hashed at most once per
            process. A dataset without sources serves what is stored, unchecked.
        views, verify, pin_memory: read-only tensors viewing the cache's file while held
            (or copies: :attr:`read_path`; :mod:`cache_store.views`), hashed once per
            process (``verify="always"``: every read); batches packed pinned if asked.
        local_cache, cache_limit: a remote sharded or exported Zarr snapshot
            (``s3://....zarr``) read through a bounded directory on this machine: each
            part (sharded) or chunk file (exported) a read needs is fetched once into
            ``local_cache``, checked, shared by every process of the machine, least
            recently used out first, never above ``cache_limit`` (bytes, or a size:
            ``"20G"``; refused up front when it cannot hold the largest unit); see
            :mod:`cache_store.local_cache` (a service URL's records: kept by ETag).
        variant, variants, variant_seed: which variant of each sample is read, where a
            run stored several (``variants=K``): see
            :class:`~cache_store.readers.variants.VariantChoice` (default: one per
            sample per epoch, :meth:`set_epoch`'s or the one ``spcache.Sampler`` deals).
        **params: recipe parameters, with a recipe name only: those that select the
            dataset (left out: any stored value), or with ``sources=`` the run's
            (left out: the default).

    The index is read on first use (``len``, indexing, ``fingerprint``) through a store
    that is closed again at once, so a parent process never holds the cache open at fork
    time. Each process then opens its own store on its first read. Safe under the fork,
    spawn and forkserver start methods and with ``persistent_workers``.

    Raises (on first use): ``FingerprintLookupError``, ``CacheNotFound``; on reads:
    ``RecordNotFound`` (naming key and cache), ``CorruptRecord`` (naming key). With
    ``on_miss="compute"``: ``NoWorkerAlive`` (no worker to compute a miss; the message
    names the command to start one), ``SampleFailed`` (the worker could not compute
    this sample: id, path and reason; other samples are unaffected), ``MissTimeout``.
    """

    def __init__(
        self,
        cache: str | os.PathLike[str] | Store,
        fingerprint_or_recipe: str | type[Recipe] | Recipe,
        fields: Iterable[str] | None = None,
        transform: Callable[[Sample], Any] | None = None,
        *,
        store_options: Mapping[str, Any] | None = None,
        sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
        on_miss: str | None = None,
        warm_ahead: int = 16,
        miss_timeout: float = 120.0,
        on_error: str = "raise",
        id_template: str | None = None,
        on_stale: str | None = None,
        local_cache: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        views: bool = False,
        verify: str = "once",
        pin_memory: bool = False,
        variant: int | None = None,
        variants: int | None = None,
        variant_seed: int = 0,
        **params: Any,
    ) -> None:
        if not isinstance(fingerprint_or_recipe, str):  # a recipe class (spcache.recipe)
            fingerprint_or_recipe = recipe_name_of(fingerprint_or_recipe)
        where = os.fspath(cache.location if isinstance(cache, Store) else cache)
        on_miss, on_stale, kind = checked_options(
            where,
            fingerprint_or_recipe,
            sources,
            on_miss=on_miss,
            on_stale=on_stale,
            id_template=id_template,
            on_error=on_error,
            warm_ahead=warm_ahead,
            miss_timeout=miss_timeout,
            verify=verify,
        )
        variant_bad = variant_problems(variant, variants, variant_seed)
        if variant_bad:
            raise ParameterError(variant_bad)
        if on_miss == "compute":  # the worker computing a miss is another process
            require_installed(fingerprint_or_recipe, "the worker that computes a miss")
        self.views, self.verify, self.pin_memory = bool(views), verify, bool(pin_memory)
        self.local_cache = local_cache_option(cache, kind, local_cache, cache_limit)
        self.cache = cache if isinstance(cache, Store) else os.fspath(cache)
        self.selector = fingerprint_or_recipe
        self.fields = None if fields is None else tuple(fields)
        self.transform = transform
        self.params = dict(params)
        self.store_options = dict(store_options or {})
        if self.local_cache is not None:
            self.store_options["local_cache"] = self.local_cache
        self.sources = sources
        self.on_miss = on_miss
        self.warm_ahead = int(warm_ahead)
        self.miss_timeout = float(miss_timeout)
        self.on_error = on_error
        self.id_template = id_template
        # made here, in the process that builds the dataset, so its workers share them
        self._skipped = SkippedSamples() if on_error == "skip" else None
        ring_here(self.views and transform is None and not self.pin_memory)  # batch slots
        self.on_stale = on_stale
        self._variants = VariantChoice(variant, variants, variant_seed)
        self.epoch = 0  # set_epoch; an EpochIndex carries its own
        # variants each sample has stored (uint16 [n]), from the index; None: one each
        self._variant_counts: np.ndarray | None = None
        # index -> (signature, record checksum) this process hashed and found current
        self._verified: tuple[int, dict[int, tuple[str, str]]] | None = None
        self._path_bytes: np.ndarray | None = None  # uint8, with sources only
        self._path_offsets: np.ndarray | None = None  # int64 [n + 1]
        # with sources: positions whose id an earlier source has, and that source's position
        self._clash_at: np.ndarray | None = None  # int64 [clashes], ascending
        self._clash_first: np.ndarray | None = None  # int64 [clashes]
        self._miss_handler: ProcessLocal[Any] | None = None  # made on the first miss
        self._fingerprint: str | None = None
        self._recipe: tuple[str, int, dict[str, Any]] | None = None
        # fields the recipe declares with a per-record first dimension (see SpcSample)
        self._variable: frozenset[str] = frozenset()
        self._id_bytes: np.ndarray | None = None  # uint8 [total id bytes]
        self._id_offsets: np.ndarray | None = None  # int64 [n + 1]
        self._store: ProcessLocal[Store] = ProcessLocal(
            functools.partial(open_store, self.cache, readonly=True, **self.store_options),
            operator.methodcaller("close"),
        )  # not Store.close: that skips overrides

    def __repr__(self) -> str:
        cache = self.cache.location if isinstance(self.cache, Store) else self.cache
        return f"CachedDataset({cache!r}, {self.selector!r}, fields={self.fields})"

    # -- index -----------------------------------------------------------------------
    def _new_store(self) -> Store:
        return self._store.opener()

    def _load_index(self) -> None:
        if self._id_offsets is not None:
            return
        if self.sources is not None:
            self._index_from_sources()
            return
        store = self._new_store()
        try:
            index = resolve_index(store, self.selector, **self.params)
        finally:
            store.close()  # nothing left open for a fork to inherit
        if type(store).__name__ == "LMDBStore":  # a local cache directory
            usage.note_read(store.location, index.fingerprint)  # once per open (spcache ls)
        self._id_bytes, self._id_offsets = index.packed_ids()
        self._variant_counts = index.variants
        self._recipe = (index.recipe, index.recipe_version, dict(index.params))
        self._variable = installed_variable_fields(*self._recipe)
        self._fingerprint = index.fingerprint
        log.debug("CachedDataset %s: %d samples", index.fingerprint, len(index))

    def _index_from_sources(self) -> None:
        """Ids and paths from the sources; fingerprint from the recipe (no store opened)."""
        from cache_store.sources.discover import describe_left_out, discover, id_clashes

        spec = get_recipe_spec(self.selector)
        resolved = spec.resolve(self.params)
        found = discover(self.sources, id_template=self.id_template)  # type: ignore[arg-type]
        items, left_out = found.items, describe_left_out(found.left_out)
        if not items:
            raise SourceError(
                self.sources,
                "no supported source files found" + (f" ({left_out})" if left_out else ""),
            )
        if left_out:
            log.info("CachedDataset over %s: %s", self.sources, left_out)
        # a later file with an earlier one's id is a sample that fails alone, as in
        # precompute (the first keeps the id): see _id_clash
        clashes = id_clashes(sid for sid, _ in items)
        self._clash_at = np.fromiter(clashes, dtype=np.int64, count=len(clashes))
        self._clash_first = np.fromiter(clashes.values(), dtype=np.int64, count=len(clashes))
        # absolute: the worker (or the service) that computes a miss has its own cwd
        self._path_bytes, self._path_offsets = pack_ids(
            [os.path.abspath(path) for _, path in items]
        )
        self._id_bytes, self._id_offsets = pack_ids([sid for sid, _ in items])
        self._recipe = (spec.name, spec.version, resolved)
        self._variable = spec.variable_length_fields(resolved)
        self._fingerprint = compute_fingerprint(spec.name, spec.version, resolved)
        log.debug("CachedDataset %s over sources: %d samples", self._fingerprint, len(items))

    def _id_clash(self, i: int) -> SourceError | None:
        """The error of the sample at position ``i`` when an earlier source has its id
        (it has no record of its own: the id's record is the first file's), else None."""
        at = self._clash_at
        if at is None or not len(at):
            return None
        j = int(i) + len(self) if int(i) < 0 else int(i)
        k = int(np.searchsorted(at, j))
        if k == len(at) or int(at[k]) != j:
            return None
        from cache_store.sources.discover import id_clash_reason

        first = self.source_path(int(self._clash_first[k]))  # type: ignore[index]
        return SourceError(self.source_path(j), id_clash_reason(self.sample_id(j), first))

    def _refuse_id_clashes(self, indices: Sequence[int]) -> None:
        if self._clash_at is not None and len(self._clash_at):
            for i in indices:
                clash = self._id_clash(i)
                if clash is not None:
                    raise clash

    def source_path(self, i: int) -> str:
        """The source file of the sample at position ``i`` (datasets over sources only)."""
        self._load_index()
        if self._path_offsets is None:
            raise ParameterError(["source_path: this dataset was not built over sources"])
        j = int(i) + len(self) if int(i) < 0 else int(i)
        self.sample_id(j)  # range check
        start, stop = self._path_offsets[j], self._path_offsets[j + 1]
        return self._path_bytes[start:stop].tobytes().decode("utf-8")  # type: ignore[index]

    @property
    def fingerprint(self) -> str:
        self._load_index()
        return self._fingerprint  # type: ignore[return-value]

    @property
    def recipe(self) -> tuple[str, int, dict[str, Any]]:
        """``(name, version, params)`` of the recipe that computed the records."""
        self._load_index()
        return self._recipe  # type: ignore[return-value]

    def __len__(self) -> int:
        self._load_index()
        return len(self._id_offsets) - 1  # type: ignore[arg-type]

    def _id_span(self, i: int) -> tuple[int, int]:
        """Where the id of the sample at position ``i`` lies in the packed ids (asked by
        every read: one index check, no property calls)."""
        offsets = self._id_offsets
        if offsets is None:
            self._load_index()
            offsets = self._id_offsets
        n = len(offsets) - 1  # type: ignore[arg-type]
        j = int(i)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"index {i} out of range for {n} samples")
        return offsets[j], offsets[j + 1]  # type: ignore[index]

    def sample_id(self, i: int) -> str:
        """The sample id at position ``i`` (negative counts from the end)."""
        start, stop = self._id_span(i)
        return self._id_bytes[start:stop].tobytes().decode("utf-8")  # type: ignore[index]

    def key(self, i: int) -> str:
        """``"<fingerprint>/<sample id>"`` of the sample at position ``i`` (its variant 0)."""
        start, stop = self._id_span(i)
        return f"{self._fingerprint}/{self._id_bytes[start:stop].tobytes().decode('utf-8')}"  # type: ignore[index]

    # -- what a sampler asks (cache_store.readers.sampler) ------------------------------
    def packed_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The ids in index order: ``(blob uint8 [total_bytes], offsets int64 [n + 1])``,
        id ``i`` at ``blob[offsets[i]:offsets[i + 1]]`` (the dataset's own arrays)."""
        self._load_index()
        return self._id_bytes, self._id_offsets  # type: ignore[return-value]

    def blocks(self) -> BlockLayout | None:
        """The block each sample lies in, which a shuffle keeps together (see
        :meth:`Store.block_layout`), or None (a cache directory, the service), asked of
        a store opened for the question and closed again."""
        self._load_index()
        if self.sources is not None:  # read-through: a cache directory or the service
            return None
        store = self._new_store()
        try:
            return store.block_layout(self._fingerprint, unpack_ids(*self.packed_ids()))  # type: ignore[arg-type]
        finally:
            store.close()

    def set_epoch(self, epoch: int) -> None:
        """``self.epoch``, set by ``Sampler.set_epoch``: the epoch read next, which picks
        each sample's variant (``variant=None``). A loader worker has the value of when
        it started (each epoch, unless ``persistent_workers``): the
        :class:`~cache_store.readers.variants.EpochIndex` a ``Sampler`` deals carries it."""
        self.epoch = int(epoch)

    def variant_at(self, i: int) -> int:
        """The variant read for index ``i`` (an int, or an ``EpochIndex`` carrying the
        epoch it was dealt in; else :attr:`epoch`)."""
        counts = self._variant_counts
        stored = 1 if counts is None else int(counts[int(i)])
        return self._variants.pick(self.sample_id(i), epoch_of(i, self.epoch), stored)

    def read_key(self, i: int) -> str:
        """The key of the record read for index ``i``: variant :meth:`variant_at`."""
        variant = self.variant_at(i)
        if variant == 0:
            return self.key(i)
        return record_key(self.fingerprint, self.sample_id(i), variant)

    def queue_ahead(self, indices: Sequence[int]) -> int:
        """Read-through (``on_miss="compute"``): queue the samples at ``indices`` that
        the cache lacks for its worker, without waiting (a sampler's read-ahead); the
        number of samples handed to the queue (0 otherwise). Raises ``NoWorkerAlive``."""
        if self.on_miss != "compute":
            return 0
        ahead = [
            (self.sample_id(i), self.source_path(i))
            for i in indices
            if self._id_clash(i) is None and not self._has(self.key(i))
        ]
        if ahead:
            self._handler().queue_ahead(ahead)
        return len(ahead)

    def restore_failed(self, entries: Iterable[Sequence[Any]]) -> None:
        """Put a sampler state's ``failed`` (``[key, id, path, reason, when]`` each) back
        into :attr:`failed`: a resumed job lists what the stopped one skipped."""
        if self._skipped is not None:
            self._skipped.restore(entries)

    # -- reading ---------------------------------------------------------------------
    def _store_here(self) -> Store:
        return self._store.get()

    def _finish(self, record: Any, i: int) -> Any:
        sample_id = self.sample_id(i)
        if record.place is not None and hands_over(self.transform):
            opener, variable, pin = self._store.opener, self._variable, self.pin_memory
            source = (opener, self.fields, self.verify, variable, SpcSample, pin)
            return LocatedSample(source, self.key(i), (record.place, record.checksum))  # hop
        sample = SpcSample(record.tensors, self._variable, sample_id)
        if self.transform is None:
            return sample
        out = self.transform(sample)
        if type(out) is dict:  # keep the declared batch layout and the sample's id
            return SpcSample(out, self._variable & out.keys(), sample_id)
        return out

    def __getitem__(self, i: int) -> Any:
        if self._skipped is None:
            return self._read_one(i)
        try:
            return self._read_one(i)
        except SKIPPABLE_ERRORS as exc:
            self._skip(i, exc)
            return None

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Batched read used by DataLoader: one store transaction for the whole batch
        (with ``on_error="skip"``, a batch with a failed sample is read again one sample
        at a time, the failed ones as ``None``)."""
        if self._skipped is None:
            return self._read_many(indices)
        try:
            return self._read_many(indices)
        except SKIPPABLE_ERRORS:
            return [self.__getitem__(i) for i in indices]

    @property
    def failed(self) -> dict[str, SkippedSample]:
        """Sample id -> :class:`~cache_store.readers.skipped.SkippedSample` (path,
        reason, when) of every sample any process of this dataset skipped so far
        (``on_error="skip"``; empty otherwise). Read in the parent after an epoch, it
        includes what the DataLoader's workers skipped. A source whose id an earlier
        source already has is listed under its path (its ``sample_id`` is that id)."""
        return {} if self._skipped is None else self._skipped.entries()

    def _skip(self, i: int, exc: BaseException) -> None:
        sample_id = self.sample_id(i)
        path = self.source_path(i) if self._path_offsets is not None else self.key(i)
        reason = one_line(exc, with_class=True)
        # a file whose id an earlier one has is listed under its path: the id is taken
        key = path if self._id_clash(i) is not None else sample_id
        if self._skipped is not None and self._skipped.add(sample_id, path, reason, key=key):
            log.warning(
                "CachedDataset %s: skipping sample %r (%s): %s",
                self._fingerprint,
                sample_id,
                path,
                reason,
            )

    @property
    def read_path(self) -> str:
        """``"views"`` or ``"copies (why)"``: the path this process's reads take."""
        return read_path(self._store_here(), self.views)

    def _records(self, keys: list[str], batch: bool) -> list[Any]:
        fields, hop = None if self.fields is None else list(self.fields), hands_over(self.transform)
        store, views = self._store_here(), self.views
        return read_records(store, keys, fields, views, self.verify, batch, hop, self.pin_memory)

    def _read_one(self, i: int) -> Any:
        self._refuse_id_clashes((i,))
        key = self.read_key(i)
        try:
            record = self._records([key], False)[0]
        except (RecordNotFound, CacheNotFound):
            if self.on_miss != "compute":
                raise
            self._on_miss([i])
            record = self._records([key], False)[0]
        if self.on_stale != "serve":
            record = self._current_records([i], [record])[0]
        return self._finish(record, i)

    def _read_many(self, indices: Sequence[int]) -> list[Any]:
        self._refuse_id_clashes(indices)
        keys = [self.read_key(i) for i in indices]
        try:
            records = self._records(keys, True)
        except (RecordNotFound, CacheNotFound):
            if self.on_miss != "compute":
                raise
            self._on_miss(indices)
            records = self._records(keys, True)
        if self.on_stale != "serve":
            records = self._current_records(indices, records)
        return [self._finish(record, i) for i, record in zip(indices, records, strict=True)]

    # -- stale records (sources=..., on_stale != "serve"): rules in readers/stale.py ---
    def _verified_here(self) -> dict[int, tuple[str, str]]:
        pid = os.getpid()
        if self._verified is None or self._verified[0] != pid:
            self._verified = (pid, {})  # what the parent verified is not inherited
        return self._verified[1]

    def _staleness(self, i: int, meta: Mapping[str, str]) -> tuple[str, str] | None:
        return staleness(self.source_path(i), meta, self._verified_here(), i)

    def _current_records(self, indices: Sequence[int], records: list[Any]) -> list[Any]:
        """``records`` with every stale one handled as ``on_stale`` says."""
        stale = {}
        for n, (i, record) in enumerate(zip(indices, records, strict=True)):
            found = self._staleness(i, record.metadata)
            if found is not None:
                stale[n] = (i, record, *found)
        if not stale:
            return records
        if self.on_stale == "error":
            i, record, path, digest = next(iter(stale.values()))
            raise StaleRecord(self.read_key(i), path, record.metadata.get("source_hash"), digest)
        out = list(records)
        for n, record in zip(stale, self._recompute([i for i, *_ in stale.values()]), strict=True):
            out[n] = record
        return out

    def _recompute(self, indices: Sequence[int]) -> list[Any]:
        """Queue the stale samples at ``indices`` again and wait until each stored record
        is current for its source (or ``miss_timeout``); their records, in order."""
        wanted = [(self.sample_id(i), self.source_path(i)) for i in dict.fromkeys(indices)]
        position = {self.read_key(i): i for i in indices}
        picks = {self.sample_id(i): self.variant_at(i) for i in indices}

        def current(key: str) -> bool:
            try:
                meta = self._store_here().record_metadata(key)
            except (RecordNotFound, CacheNotFound):
                return False
            return self._staleness(position[key], meta) is None

        # QueueReadThrough waits on ``current``; over HTTP the service decides what is stale
        wait_until_current(
            lambda: self._handler().fetch(
                current, wanted, (), stale=[sid for sid, _ in wanted], picks=picks
            ),
            current,
            position,
            miss_timeout=self.miss_timeout,
            what=f"{len(wanted)} stale record(s) of {self.fingerprint} "
            f"({', '.join(repr(s) for s, _ in wanted[:3])})",
        )
        return [
            self._store_here().get_record(self.read_key(i), fields=self.fields) for i in indices
        ]

    # -- read-through (on_miss="compute") ---------------------------------------------
    def _new_read_through(self) -> ProcessLocal[Any]:
        """This dataset's read-through client, one per process."""
        name, _, params = self.recipe
        return read_through_client(
            self.cache,
            name,
            params,
            self.fingerprint,
            miss_timeout=self.miss_timeout,
            store_options=self.store_options,
            variants=self._variants.computed,
        )

    def _has(self, key: str) -> bool:
        try:
            return self._store_here().has(key)
        except CacheNotFound:  # no writer has created the cache yet
            return False

    def _on_miss(self, indices: Sequence[int]) -> None:
        """Queue the batch's missing samples and the next ``warm_ahead`` uncached ones,
        then wait for the batch's records (see :mod:`cache_store.readers.queue_read_through`)."""
        missing = [i for i in dict.fromkeys(indices) if not self._has(self.read_key(i))]
        wanted = [(self.sample_id(i), self.source_path(i)) for i in missing]
        picks = {self.sample_id(i): self.variant_at(i) for i in missing}
        ahead: list[tuple[str, str]] = []
        j = max(int(i) for i in indices) + 1
        while len(ahead) < self.warm_ahead and j < len(self):
            if self._id_clash(j) is None and not self._has(self.key(j)):
                ahead.append((self.sample_id(j), self.source_path(j)))
            j += 1
        self._handler().fetch(self._has, wanted, ahead, picks=picks)

    def _handler(self) -> Any:
        if self._miss_handler is None:
            self._miss_handler = self._new_read_through()
        return self._miss_handler.get()

    def read_through_queued(self) -> int:
        """Samples this process queued for computing (reused queue items not counted)."""
        handler = None if self._miss_handler is None else self._miss_handler.peek()
        return 0 if handler is None else int(handler.queued)

    def prefetch(self, indices: Sequence[int]) -> None:
        """With ``local_cache``: fetch what the samples at ``indices`` are read from
        (their parts, chunk files or records) in a thread of this process, in that
        order, so a loader finds them local; a sampler's read-ahead calls it. Nothing
        otherwise."""
        if self.local_cache is not None and len(indices):
            self._store_here().prefetch([self.read_key(i) for i in indices])

    def close(self) -> None:
        """Close this process's store (it re-opens on the next read)."""
        self._store.close()
        if self._miss_handler is not None:
            self._miss_handler.close()
