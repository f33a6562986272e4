"""Helpers shared by test modules: synthetic records, the store contract, servers, child
processes and reference implementations. Test modules import from here, never from
each other or from a conftest."""
