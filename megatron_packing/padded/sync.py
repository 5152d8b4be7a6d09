"""Keep data-parallel ranks in lockstep in padded mode.

- `align_microbatch_count`: every rank runs the same number of micro-batches. A rank with fewer
  pads its schedule with ``None`` dummies, which the train step runs as zero-loss micro-batches;
  a rank that simply ran fewer would leave the others waiting in the gradient all-reduce forever.
- `TokenBudgetController`: the token budget can change while a job runs, through an API call
  or a small JSON/YAML control file. Every rank switches at the same step: changes are agreed
  in a collective at fixed step boundaries and take effect from a step no rank has planned yet.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_packing.common.validation import require_positive_int
from megatron_packing.padded.control_file import (
    BUDGET_FILE,
    NO_VALUE,
    BudgetRequest,
    read_budget_file,
    write_budget_file,
)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _collective_device(group: Any) -> torch.device:
    """CPU for gloo; the current CUDA device for NCCL (which only reduces GPU tensors)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_max(values: list[int], group: Any = None) -> list[int]:
    if not _distributed():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in tensor.cpu().tolist()]


def pad_schedule(schedule: list[Any], count: int) -> list[Any]:
    """``schedule`` followed by ``None`` dummies up to ``count`` micro-batches."""
    if count < len(schedule):
        raise ValueError(f"cannot pad {len(schedule)} micro-batches down to {count}")
    return list(schedule) + [None] * (count - len(schedule))


def align_microbatch_count(schedule: list[Any], group: Any = None) -> list[Any]:
    """Pad ``schedule`` with ``None`` to the largest micro-batch count over ``group``.

    All ranks of ``group`` must call this at the same point (it is an all_reduce MAX). Without
    an initialised process group it returns a copy of ``schedule``.
    """
    (count,) = _all_reduce_max([len(schedule)], group)
    return pad_schedule(schedule, count)


# --------------------------------------------------------------------------- runtime budget
class BudgetTarget(Protocol):
    """What the controller drives: normally the padded batch sampler."""

    @property
    def next_step(self) -> int: ...

    def set_max_tokens(self, max_tokens: int, from_step: int) -> None: ...


class TokenBudgetController:
    """Agrees run-time budget changes over a process group so all ranks switch at one step.

    Call `step_boundary(step)` on every rank before each training step. Every ``check_every``
    steps it runs two all_reduce MAX calls: each rank offers the newest request it knows (from
    `request` or from reading ``control_file``), the newest version wins, and the change takes
    effect from the largest of the requested step and the first step that no rank has planned
    yet. Ranks may see the file change at different times; they still apply the same change
    from the same step, and they never disagree on the number of collectives.
    """

    def __init__(
        self,
        max_tokens: int,
        *,
        control_file: str | Path | None = None,
        check_every: int = 10,
        group: Any = None,
        target: BudgetTarget | None = None,
        read_on_all_ranks: bool = True,
        report: Callable[[str], None] | None = None,
    ) -> None:
        max_tokens = require_positive_int("max_tokens", max_tokens)
        check_every = require_positive_int("check_every", check_every)
        self.control_file = Path(control_file) if control_file is not None else None
        self.check_every = check_every
        self.group = group
        self.target = target
        self.read_on_all_ranks = read_on_all_ranks
        self._changes: list[tuple[int, int]] = [(0, max_tokens)]  # (from_step, budget), sorted
        self._applied_version = NO_VALUE
        self._applied_request: tuple[int, int] | None = None
        self._pending: BudgetRequest | None = None
        # ``report`` hears every agreed change and every refused request; without it a refusal
        # is a warning and a change goes unsaid.
        self._report = report

        self._bad_file: str | None = None  # the last unreadable file's complaint, said once

    # ------------------------------------------------------------------ API
    def request(self, max_tokens: int, from_step: int | None = None) -> None:
        """Ask for a new budget; it is agreed with the other ranks at the next check."""
        max_tokens = require_positive_int("max_tokens", max_tokens)
        self._pending = BudgetRequest(max_tokens, time.time_ns(), NO_VALUE if from_step is None else from_step)

    def budget_at(self, step: int) -> int:
        """The budget in force at ``step``."""
        budget = self._changes[0][1]
        for start, value in self._changes:
            if start <= step:
                budget = value
        return budget

    @property
    def changes(self) -> list[tuple[int, int]]:
        return list(self._changes)

    # ------------------------------------------------------------------ the collective
    def _local_offer(self) -> BudgetRequest | None:
        offers = [self._pending] if self._pending is not None else []
        if self.control_file is not None and (self.read_on_all_ranks or self._rank() == 0):
            try:
                from_file = read_budget_file(self.control_file)
                self._bad_file = None
            except ValueError as err:  # raising on one rank alone would hang the others
                if str(err) != self._bad_file:
                    self._refuse(f"ignoring the budget control file: {err}; the token budget "
                                 f"stays {self.budget_at(self._last_step)}")
                self._bad_file = str(err)
                from_file = None
            if from_file is not None:
                offers.append(from_file)
        offers = [offer for offer in offers if offer.version > self._applied_version]
        return max(offers, key=lambda offer: offer.version) if offers else None

    def _rank(self) -> int:
        return dist.get_rank(self.group) if _distributed() else 0

    _last_step = 0

    def step_boundary(self, step: int) -> int:
        """Run the agreement when ``step`` is a check step; return the budget for ``step``."""
        self._last_step = step
        if step % self.check_every == 0:
            self._agree(step)
        return self.budget_at(step)

    def _agree(self, step: int) -> None:
        offer = self._local_offer()
        planned = self.target.next_step if self.target is not None else step
        version, first_free = _all_reduce_max(
            [offer.version if offer is not None else NO_VALUE, max(planned, step)], self.group
        )
        if version == NO_VALUE:
            return
        mine = offer if offer is not None and offer.version == version else None
        budget, from_step = _all_reduce_max(
            [mine.max_tokens if mine else NO_VALUE, mine.from_step if mine else NO_VALUE], self.group
        )
        self._applied_version = version
        self._pending = None
        if self._applied_request == (budget, from_step):
            return  # the same request seen again (e.g. a later copy of the file): nothing new
        self._applied_request = (budget, from_step)
        if from_step != NO_VALUE and from_step < first_free:
            self._refuse(f"refused the budget change to {budget} from step {from_step}: steps "
                         f"up to {first_free - 1} are already planned; the token budget stays "
                         f"{self.budget_at(first_free)} (ask for step {first_free} or later)")
            return
        start = max(from_step, first_free)
        self._changes = [(s, b) for s, b in self._changes if s < start] + [(start, budget)]
        if self.target is not None:
            self.target.set_max_tokens(budget, start)
        if self._report is not None:
            self._report(f"token budget {budget} from step {start} (was "
                         f"{self.budget_at(start - 1)})" if start > 0
                         else f"token budget {budget} from step 0")

    def _refuse(self, message: str) -> None:
        if self._report is not None:
            self._report(message)
        else:
            warnings.warn(message, stacklevel=3)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The agreed changes and the newest request applied, so that a resumed job neither
        forgets a change nor applies the same control file twice."""
        return {"changes": [list(change) for change in self._changes],
                "applied_version": self._applied_version,
                "applied_request": None if self._applied_request is None
                else list(self._applied_request)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._changes = [(int(s), int(b)) for s, b in state["changes"]]
        self._applied_version = int(state["applied_version"])
        request = state["applied_request"]
        self._applied_request = None if request is None else (int(request[0]), int(request[1]))


__all__ = [
    "BUDGET_FILE",
    "BudgetRequest",
    "BudgetTarget",
    "TokenBudgetController",
    "align_microbatch_count",
    "pad_schedule",
    "read_budget_file",
    "write_budget_file",
]
