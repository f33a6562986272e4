"""Source files: discovery (which files a path names), the gate every process opens and
hashes them through, and content hashes."""
