"""The content causes beside prefix_diverged: rewritten history, moved content, another identity. Pure.

Each reads the anchors of one stored run of new blocks (fingerprints.py: `positions` ascending,
all below `length`) and which of them were seen before, and returns the span of new tokens it
explains, `(start, stop)`, or None (docs/kv-events.md, one section per cause):

- `rewritten_span`: the new tokens re-render text the model generated (decode-filled blocks'
  fingerprints) behind a cached prefix: the chat template rendered an earlier assistant turn other
  than it was generated, so the chain left the cache at that turn. Had it been verbatim, everything
  up to the end of the re-rendered text would have hit: the span runs from the divergence point to
  the end of the last generated anchor's window and a block more (the answer's last, partial block
  is never stored as decode, so its text is never learnt), in whole hit units.
- `moved_span`: known runs joined only by *junctions* (the unseen anchors between two runs all fit
  in one fingerprint window: the windows that straddle the seam between two pieces of known
  content; the run after a seam a hit unit or more): the same sections in another order. A fixed
  order would have served the joined stretch: from `start` (where the caller's own rule stopped)
  to the last joined run's end, in whole hit units.
- `seams` (order-aware, docs/kv-events.md "content_moved"): where known content joins known content
  it did not follow before: two seen anchors next to each other whose pair (layouts.py's anchor
  order) is new, or seen anchors either side of a few unseen ones (SEAM_SPREAD). A move changes at
  least three adjacencies (the one at the divergence point and two more); a per-request field
  changes one. Fingerprints of token runs do not depend on block alignment, so a seam or a field
  with no anchor of its own still shows as a pair never seen in that order (or as none at all).
- `moved_from_divergence` (order-aware): known content from the divergence point on, joined at two
  seams or more (or one two units or more in, the stretch running to the end: the second seam lies
  past the stored blocks; an anchor pair never seen at all, not only in another context), the sections
  between them half a hit unit or 2 x ANCHOR_SPACING tokens (the less): the moved sections start at
  the divergence point, where the first seam shows no pair. A per-request field changes one
  adjacency: one seam; sentences recombined into a question are shorter sections.
- `foreign_span`: content known only under another adapter or cache salt: from the first such
  anchor to the last one's window, in whole hit units (not a fault; vLLM isolates them on purpose).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from .fingerprints import ANCHOR_SPACING, K

SEAM_SPREAD = 3 * K  # unseen anchors a seam or a short field (up to 2 K tokens) holds: windows over it
SEAM_GAP = K + 4 * ANCHOR_SPACING  # two seen anchors further apart, with none between: unique content


def whole_units(start: int, stop: int, unit: int) -> tuple[int, int] | None:
    """The span cut to whole hit units from `start`; None when not even one fits."""
    if unit <= 0 or stop - start < unit:
        return None
    return start, start + (stop - start) // unit * unit


def rewritten_span(
    positions: Sequence[int], generated: Sequence[bool], length: int, unit: int, unstored: int = 0
) -> tuple[int, int] | None:
    """From the divergence point to the end of the last anchor of generated text and `unstored`
    tokens more (whole units)."""
    if True not in generated:
        return None
    return whole_units(0, min(_end(positions, generated, length) + unstored, length), unit)


def _end(positions: Sequence[int], flags: Sequence[bool], length: int) -> int:
    """Where the content of the last flagged anchor ends: K / 2 tokens into the next anchor's window
    (at least its own window's end; as a known run's end is estimated, reorder.py), the end of the
    new tokens when no anchor follows it."""
    return _end_at(positions, len(flags) - 1 - flags[::-1].index(True), length)


def _end_at(positions: Sequence[int], last: int, length: int) -> int:
    if last == len(positions) - 1:
        return length
    return min(max(positions[last] + K, positions[last + 1] + K // 2), length)


def known_runs(
    positions: Sequence[int], seen: Sequence[bool], length: int
) -> list[tuple[int, int, int, int]]:
    """Each maximal run of seen anchors: (first index, last index, start token, end token); a run
    covers its anchors' windows (start at its first anchor, end K tokens past its last)."""
    runs, first = [], None
    for i, known in enumerate(seen):
        if known and first is None:
            first = i
        elif not known and first is not None:
            runs.append((first, i - 1, positions[first], min(positions[i - 1] + K, length)))
            first = None
    if first is not None:
        runs.append((first, len(seen) - 1, positions[first], min(positions[-1] + K, length)))
    return runs


def moved_span(
    positions: Sequence[int], seen: Sequence[bool], length: int, unit: int, first: int, start: int
) -> tuple[int, int] | None:
    """The known run holding anchor `first` and the runs junction-joined after it (two runs or
    more), from token `start` to the last one's end in whole hit units; None without a junction."""
    runs = [run for run in known_runs(positions, seen, length) if run[1] >= first]
    last = 0
    while last + 1 < len(runs) and _junction(positions, runs[last], runs[last + 1], unit):
        last += 1
    return whole_units(start, runs[last][3], unit) if last else None


def _junction(positions: Sequence[int], before: tuple, after: tuple, unit: int) -> bool:
    """Two runs joined only by a seam: the unseen anchors between them fit in one window, and the
    run after it is a hit unit or more."""
    gap = positions[before[1] + 1 : after[0]]
    return gap[-1] - gap[0] < K and after[3] - after[2] >= unit


def foreign_span(
    positions: Sequence[int], foreign: Sequence[bool], length: int, unit: int
) -> tuple[int, int] | None:
    """From the first anchor known only under another identity (the divergence point when it is the
    first anchor) to the last one's content, in whole hit units."""
    if True not in foreign:
        return None
    first = foreign.index(True)
    return whole_units(positions[first] if first else 0, _end(positions, foreign, length), unit)


def seams(
    positions: Sequence[int], seen: Sequence[bool], paired: Sequence[bool], first: int
) -> tuple[list[int], int]:
    """From seen anchor `first` along the known stretch: the seen anchors right after a seam, and the
    stretch's last seen anchor. `paired[i]`: anchors i and i + 1 were seen next to each other before.
    The stretch ends at unique content: unseen anchors spread over SEAM_SPREAD or more, or SEAM_GAP
    tokens with no anchor between seen anchors whose pair is new."""
    joins: list[int] = []
    last = first
    for k in range(first + 1, len(seen)):
        if not seen[k]:
            continue
        if k == last + 1:
            if not paired[last]:
                if positions[k] - positions[last] > SEAM_GAP:
                    break
                joins.append(k)
        elif positions[k - 1] - positions[last + 1] < SEAM_SPREAD:
            joins.append(k)
        else:
            break
        last = k
    return joins, last


def moved_from_divergence(
    positions: Sequence[int], seen: Sequence[bool], pair_seen: Sequence[bool], length: int, unit: int
) -> tuple[int, int] | None:
    """Known content from the first anchor (seen) on, joined at seams: a pair never seen next to each
    other however far apart (`pair_seen[i]`: anchors i and i + 1 were), or a few unseen anchors
    between seen ones (SEAM_SPREAD; more: unique content ends the stretch). From the divergence point
    to the stretch's end in whole hit units when there are two seams or more, the sections between
    them half a hit unit or two anchor spacings (the less) or more (a seam taken halfway between
    the last whole window before it and the first anchor after it), and the stretch's pairs in
    order at least twice as often as not (forgotten pairs read as seams). One seam is enough where
    the stretch runs to the last anchor, two hit units or more before the seam and one after (two
    sections swapped whose second seam lies past the stored blocks): a field behind known content
    sits in the divergence point's block, and known content of two units there did not follow the
    cached prefix before, or that block would have hit. None otherwise."""
    if not seen or not seen[0] or unit <= 0 or False not in pair_seen:  # each seam is a new pair
        return None
    bounds: list[int] = []
    last, in_order = 0, 0
    for k in range(1, len(seen)):
        if not seen[k]:
            continue
        if k == last + 1:
            if pair_seen[last]:
                in_order += 1
            else:  # joined, however far apart: the content either side was known, never next to each other
                bounds.append((positions[last] + K + positions[k]) // 2)
        elif positions[k - 1] - positions[last + 1] < SEAM_SPREAD:
            bounds.append((positions[last] + K + positions[k]) // 2)
        else:
            break
        last = k
    if len(bounds) == 1 and last == len(seen) - 1 and in_order >= 2:  # the second seam not stored
        if bounds[0] >= 2 * unit and length - bounds[0] >= unit:
            return whole_units(0, _end_at(positions, last, length), unit)
        return None
    if len(bounds) < 2 or in_order < 2 * len(bounds):
        return None
    shortest = min(unit // 2, 2 * ANCHOR_SPACING)
    if any(bounds[i + 1] - bounds[i] < shortest for i in range(len(bounds) - 1)):
        return None
    return whole_units(0, _end_at(positions, last, length), unit)


def gap_changed(positions: Sequence[int], before: Sequence[int | None], start: int, last: int) -> bool:
    """Whether two consecutive anchors from token `start` on (up to anchor `last`) lie further apart or
    closer than when their pair was last stored: a section with no anchor of its own moved in or out
    between them, where no pair shows a seam. `before`: each pair's distance as last stored (None:
    never). A per-request field sits in the divergence point's block, before `start`: one change, where
    the block hash shows it; a gap that changed past it is a second change."""
    begin = bisect_left(positions, start)
    return any(
        was is not None and was != b - a
        for a, b, was in zip(
            positions[begin:last], positions[begin + 1 : last + 1], before[begin:last], strict=False
        )
    )
