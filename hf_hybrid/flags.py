"""Typed settings read once from the `hybrid_*` flags.

Each capability keeps the settings it reads in a frozen dataclass (`jumps/config.py`, `guard/config.py`, ...) whose
fields name their flag. A flag's default and documentation have one owner, `HybridTrainingArguments` (config.py);
its range check has one owner too, the capability that reads the value, and names the flag in its error.
"""

from __future__ import annotations

from dataclasses import Field, field, fields
from typing import Any, TypeVar

T = TypeVar("T", bound="FlagSettings")


def flag(name: str) -> Any:
    """A field read from the flag `name`."""
    return field(metadata={"flag": name})


def section(cls: type[FlagSettings]) -> Any:
    """A field that is a capability's own settings, read from its flags."""
    return field(metadata={"section": cls})


class FlagSettings:
    """Mixed into a frozen dataclass of `flag(...)` and `section(...)` fields (and constants with defaults)."""

    @classmethod
    def from_flags(cls: type[T], flags: Any) -> T:
        """Read from an object with the `hybrid_*` attributes (`HybridTrainingArguments`); validates."""
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if "flag" in f.metadata:
                values[f.name] = getattr(flags, f.metadata["flag"])
            elif "section" in f.metadata:
                values[f.name] = f.metadata["section"].from_flags(flags)
        return cls(**values)

    @classmethod
    def flag_names(cls) -> list[str]:
        """Every flag read by these settings and their sections."""
        names = []
        for f in fields(cls):  # type: ignore[arg-type]
            names += [f.metadata["flag"]] if "flag" in f.metadata else []
            names += f.metadata["section"].flag_names() if "section" in f.metadata else []
        return names

    def at_least(self, bound: int, *names: str) -> None:
        """Each named field must be >= `bound`."""
        for name in names:
            self.require(name, getattr(self, name) >= bound, f"must be >= {bound}")

    def positive(self, *names: str) -> None:
        """Each named field must be > 0."""
        for name in names:
            self.require(name, getattr(self, name) > 0, "must be > 0")

    def require(self, name: str, ok: bool, why: str) -> None:
        """Raise ValueError naming the flag behind field `name` unless `ok`."""
        if not ok:
            spec: Field = next(f for f in fields(self) if f.name == name)  # type: ignore[arg-type]
            raise ValueError(f"--{spec.metadata.get('flag', name)}: {why} (got {getattr(self, name)!r})")
