"""Views: records read as tensors over this process's own read-only mapping of the cache's
files, verified once per version (:mod:`cache_store.views.records`); the mappings
(:mod:`cache_store.views.mapping`); and the batches a DataLoader worker hands over as
where its verified records lie, not their bytes (:mod:`cache_store.views.hop`).
"""
