"""Source files: discovery (which files a path names), the gate every process opens and
hashes them through, content hashes, and whether a stored record is still current for
its source (freshness)."""
