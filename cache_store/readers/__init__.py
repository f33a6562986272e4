"""Training-side readers: CachedDataset, its collate functions, and read-through over the job queue or the service."""
