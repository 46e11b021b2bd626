"""How the batch engine shares its slots between requests (`SlotShares`): a request is one client's
n choices, or the prompts it sent together (a `group`), and no request's many sequences may keep
another request out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from .sequence import SequenceState


class SlotShares:
    """The slots each request holds this step, and who is owed the next one. Each free slot goes
    to the request holding the fewest, its oldest sequence first; when every slot is taken, the
    request holding the most, when that is more than one above the one waiting, gives up its
    youngest decoding sequence after this step (paused, its cache kept), so slots even out."""

    def __init__(self, running: Iterable[SequenceState]):
        self.held = Counter(s.group for s in running if not s.pausing)

    def next(self, ready: Sequence[SequenceState]) -> SequenceState:
        """The sequence owed the next free slot, of those `ready` to start or resume."""
        return min(ready, key=lambda s: (self.held[s.group], s.uid))

    def take(self, s: SequenceState) -> None:
        """`s` took a slot."""
        self.held[s.group] += 1

    def to_pause(self, decoding: Iterable[SequenceState], wanting: SequenceState) -> SequenceState | None:
        """Every slot is taken and `wanting` waits: the decoding sequence to give its slot up after
        this step, or None when the slots are even enough."""
        candidates = [s for s in decoding if not s.pausing]
        if not candidates:
            return None
        most = max(self.held[s.group] for s in candidates)
        if most <= self.held[wanting.group] + 1:
            return None
        return max((s for s in candidates if self.held[s.group] == most), key=lambda s: s.uid)
