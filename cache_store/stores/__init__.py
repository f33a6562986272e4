"""Where records rest: the store contract (base), the LMDB cache, the HTTP reader, and walks
isolated in a child process."""
