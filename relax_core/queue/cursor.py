"""A single consumer's position in a stage, saved in its checkpoint so a resume is exact.

Entries of a derived stage can land out of order (two workers finish seq 5 before seq 4), so a
position is a watermark (every seq <= `through` consumed) plus the seqs consumed beyond it. A
trainer that saves this with its weights neither repeats nor skips an entry when resumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageCursor:
    through: int = -1
    """Every seq <= through has been consumed."""
    beyond: set[int] = field(default_factory=set)
    """Consumed seqs above the watermark (out-of-order arrivals)."""

    def consumed(self, seq: int) -> bool:
        return seq <= self.through or seq in self.beyond

    def advance(self, seq: int) -> None:
        """Mark `seq` consumed; ValueError if it already was (a repeat is a bug upstream)."""
        if self.consumed(seq):
            raise ValueError(f"seq {seq} was already consumed (cursor {self.to_dict()})")
        self.beyond.add(seq)
        while self.through + 1 in self.beyond:
            self.through += 1
            self.beyond.remove(self.through)

    def unconsumed(self, committed: list[int]) -> list[int]:
        """The seqs of `committed` not consumed yet, in order."""
        return [s for s in committed if not self.consumed(s)]

    def to_dict(self) -> dict[str, Any]:
        return {"through": self.through, "beyond": sorted(self.beyond)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageCursor:
        try:
            through = int(data["through"])
            beyond = {int(s) for s in data.get("beyond", [])}
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"bad stage cursor {data!r}: {err}") from err
        if any(s <= through for s in beyond):
            raise ValueError(f"bad stage cursor {data!r}: 'beyond' holds seqs <= 'through'")
        return cls(through, beyond)
