"""What names a generated kernel: its template and the values it is specialized on. Launch counts,
records and tuning name kernels by it; `render.py` makes its text."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """A template plus the values it is specialized on (dtypes, flags, block sizes)."""

    template: str
    key: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, template: str, **key: Any) -> KernelSpec:
        return cls(template, tuple(sorted(key.items())))

    @property
    def name(self) -> str:
        """The template, and the key's `mode` where one template renders several kernels
        (`"cross_entropy:backward"`): what launch counts and tests call the kernel."""
        mode = dict(self.key).get("mode")
        return self.template if mode is None else f"{self.template}:{mode}"

    def describe(self) -> str:
        """The key on one line; long values (generated code) are shown by their size."""
        return ", ".join(
            f"{k}=<{len(v)} items>" if isinstance(v, tuple) and len(repr(v)) > 80 else f"{k}={v}"
            for k, v in self.key
        )
