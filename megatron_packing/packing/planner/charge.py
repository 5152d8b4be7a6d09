"""What a step's micro-batches cost beyond its tokens: the planner's price of one more micro-batch.

A bin costs ``m`` of its own (``microbatch_cost_tokens``, in tokens of linear work;
`balance.bin_costs`), and every rank runs the step's bins rounded up to a multiple of dp. A size
whose micro-batches hold its tokens in fewer rows is shorter by ``m`` per row saved; its tokens'
own cost is paid whichever step takes them. So the planner charges a size ``k`` packed into
``c`` bins ``m x (first_multiple(c, dp) - T_k / C)`` tokens: ``m`` per micro-batch beyond the
rows its ``T_k`` tokens fill. That charge is added to the size's distance from the running token
load, the measure by which the planner otherwise picks among equally good sizes (the aligned
sizes the search ranks, the padded ones `padding.rank_padded` weighs): a more even step against
a shorter one, in one unit. With ``m = 0`` the charge is 0 and every choice is the distance's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_packing.packing.dp_rounding import first_multiple


@dataclass(frozen=True)
class MicrobatchCharge:
    """The charge of each size of a read-ahead (module docstring); call with (size, bins)."""

    cost: float  # m, tokens per micro-batch
    dp: int
    capacity: int
    tokens: np.ndarray  # prefix sums of the read-ahead's lengths: tokens[k] for size k

    def __call__(self, size: int, bins: int) -> float:
        rows = first_multiple(int(bins), self.dp)
        return self.cost * (rows - float(self.tokens[size]) / self.capacity)
