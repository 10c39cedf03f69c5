"""Differential fuzzing of the seqfast backend: random programs built from the spellings each
family accepts, compiled with seqfast and compared with eager."""
