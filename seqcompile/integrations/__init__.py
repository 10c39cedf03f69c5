"""Integrations with model libraries: small changes to how a library's models are called, so that
the graph seqfast compiles holds what it can fuse."""
