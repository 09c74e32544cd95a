"""Which (query chunk, key chunk) pairs ring attention computes, and with which flashdl window.

Pure integer geometry, no torch.distributed: the layouts (which global chunks a rank holds), the
classification of a chunk pair under a global window (skipped, unmasked, or a masked sub-block
with the window flashdl needs for it), and the last ring step any rank needs.

Global rule (flashdl's, with seqlen_q == seqlen_k over the whole sequence): key j is visible to
query i iff ``i - left <= j <= i + right``, ``-1`` unbounded, causal being ``right = 0``. Query
chunk a covers global rows ``[a c, (a + 1) c)``, key chunk b columns ``[b c, (b + 1) c)``; in the
chunks' local indices the rule reads ``i' - L <= j' <= i' + R`` with ``L = left + (b - a) c`` and
``R = right - (b - a) c``.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

from . import _args, _checks

LAYOUTS = ("zigzag", "contiguous")

# An unbounded side of the window: larger than any sequence, so that the arithmetic needs no case.
_UNBOUNDED = 1 << 62


def chunks_of(rank: int, world: int, layout: str) -> List[int]:
    """The global chunk indices rank holds, in order: chunks of s / W (contiguous) or of
    s / 2W (zigzag) rows."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'zigzag' or 'contiguous', got {layout!r}")


def global_window(causal: bool, window_size) -> Tuple[int, int]:
    """(left, right) of the global rule, unbounded sides as a huge int; causal fixes right = 0
    (flashdl's rule: causal is the window (-1, 0) and overrides right). causal and window_size
    are checked by flashdl.attention's rules (a bool; a pair of ints, a float refused)."""
    causal = _checks.flag("causal", causal)
    left, right = _args.window_pair(window_size)
    if left < -1 or right < -1:
        raise ValueError(
            "window_size: expected (left, right) with each >= 0 or -1 for "
            f"unbounded, got ({left}, {right})"
        )
    left = _UNBOUNDED if left == -1 else left
    right = 0 if causal else (_UNBOUNDED if right == -1 else right)
    return left, right


class Block(NamedTuple):
    """The part of a chunk pair that is computed: query rows [q0, q1) and key rows [k0, k1) of
    the chunks, with flashdl's window (left, right) for that sub-block, or window None when every
    query sees every key (no mask at all)."""

    q0: int
    q1: int
    k0: int
    k1: int
    window: Optional[Tuple[int, int]]


def pair_block(a: int, b: int, c: int, left: int, right: int) -> Optional[Block]:
    """How query chunk a sees key chunk b (chunks of c rows) under the global window (left,
    right) of :func:`global_window`: None when no query sees any key (the pair is skipped).

    A partial pair is trimmed to the rows that see some key and the keys some row sees; flashdl's
    window is relative to the bottom-right diagonal of the sub-block (rows [q0, q1), keys [k0,
    k1)), whose offset is D = k1 - q1 in the chunks' coordinates, so it gets (L + D, R - D):
    both >= 0 (or unbounded) because the trimming bounds D by -L <= D <= R.
    """
    delta = (b - a) * c
    lo, hi = left + delta, right - delta  # i' - lo <= j' <= i' + hi
    if lo <= -c or hi <= -c:
        return None
    if lo >= c - 1 and hi >= c - 1:
        return Block(0, c, 0, c, None)
    q0, q1 = max(0, -hi), min(c, c + lo)
    k0, k1 = max(0, q0 - lo), min(c, q1 + hi)
    d = k1 - q1
    sq, sk = q1 - q0, k1 - k0
    wl, wr = lo + d, hi - d
    # Sides at least as wide as the sub-block bound nothing: -1 (flashdl would do the same).
    window = tuple(-1 if w >= sq + sk else w for w in (wl, wr))
    return Block(q0, q1, k0, k1, window)  # type: ignore[arg-type]


def last_step(world: int, layout: str, c: int, left: int, right: int) -> int:
    """The last ring step at which some rank has a pair to compute (0: only its own chunks).
    K and V need only that many hops, and the backward's gradient accumulators return to their
    owner from there in one send."""
    last = 0
    for step in range(1, world):
        for rank in range(world):
            owner = (rank - step) % world
            if any(
                pair_block(a, b, c, left, right) is not None
                for a in chunks_of(rank, world, layout)
                for b in chunks_of(owner, world, layout)
            ):
                last = step
                break
    return last
