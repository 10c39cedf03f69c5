"""What every stage may read of how seqcompile is set, at the ground floor: the environment's debug
switches (`SEQFAST_INTERPRET`, `SEQFAST_POISON`, `SEQFAST_STRICT`: read when used, not options)
and `OptionError`, the error for a bad option or setting. `options.py`, which checks options
against the registry, sits above the operators; this module lets the operators' runtime and the
kernel cache below them raise and read settings without importing it."""

from __future__ import annotations

import os

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def switch_on(name: str) -> bool:
    """Whether the environment switch `name` is set to a true value."""
    return os.environ.get(name, "").strip().lower() in TRUE_WORDS


class OptionError(ValueError):
    """An unknown option name or an invalid value."""
