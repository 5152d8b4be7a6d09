"""The bin compositions `megatron-packing calibrate` times at a capacity; pure.

To fix ``a + b T + c sum(s^2)`` (`cost_fit`) the compositions must differ in token total and in
sequence mix: full rows from one sequence of the whole capacity down to 128 short ones (the
same tokens, the attention falling 128-fold), two mixed full rows, and partly full rows (one
sequence of three quarters, half and a quarter of the capacity; a half and a quarter row of
short sequences). They are ordered so that the first ones timed already fix all three
constants (a full row of one sequence, a half row of one, a full row of many), should a time
limit stop the timing early.
"""

from __future__ import annotations

MIN_LENGTH = 1


def design_compositions(capacity: int) -> list[list[int]]:
    """At least 12 distinct compositions (lists of sequence lengths, each summing to at most
    ``capacity``) for a capacity of at least 64 tokens."""
    if capacity < 64:
        raise ValueError(f"a capacity of at least 64 tokens is needed to vary the sequence mix, "
                         f"got {capacity}")
    c = capacity

    def full(count: int) -> list[int]:
        return [c // count] * count

    first = [full(1), [c // 2], full(128 if c >= 128 else c // 2)]
    rest = [full(n) for n in (2, 4, 8, 16, 32, 64)]
    rest += [[c // 2, c // 4, c // 8, c - c // 2 - c // 4 - c // 8],
             [c * 3 // 4] + [c // 16] * 4,
             [c * 3 // 4], [c // 4], [c // 8] * 4, [c // 32] * 8, [c // 64] * 16]
    out: list[list[int]] = []
    for lengths in first + rest:
        lengths = [s for s in lengths if s >= MIN_LENGTH]
        if lengths and lengths not in out:
            out.append(lengths)
    return out
