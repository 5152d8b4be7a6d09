"""Start data-parallel worker processes on CPU (gloo) with megatron parallel state initialised.

Two ways in: `spawn_data_parallel` starts the ranks itself and supervises them; under
``torchrun`` (its ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR`` environment) the
current process is one rank and `run_as_torchrun_rank` runs it without spawning.

No process outlives the launcher (`megatron_packing.common.process_lifetime`): each rank leads
a process group holding everything it starts (loader workers, checkpoint writer helpers, the
``torch_dist`` writer's manager process); a rank whose launcher dies kills its group, and the
launcher kills a rank's group before it reaps the rank.
SIGINT / SIGTERM never kill a rank mid-step: they set a stop request that the ranks agree on
at the next step boundary (`agreed_stop_signal`), so every rank stops at the same step.
The spawning launcher turns its own SIGINT / SIGTERM into that request for every rank, kills
them after ``grace_s`` or at a second signal, and raises `RunInterrupted`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing.connection
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_packing.common import process_lifetime, quiet_start

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_ENV = "MEGATRON_PACKING_DIST_TIMEOUT_S"
"""Seconds a collective waits for its peers before failing (default: torch's 30 minutes).
The tests set it low, so that ranks that fell out of step fail in seconds, not half an hour."""
_stop_request = {"signal": 0}


class RankFailed(RuntimeError):
    """One rank failed; the first failure, as one message naming the rank.

    ``refusal``: the rank refused its input (a config, checkpoint or data error: exit code 2);
    otherwise a fault (the rank died) or a bug (``detail`` holds the traceback).
    """

    def __init__(self, rank: int, message: str, *, refusal: bool, detail: str = "") -> None:
        self.rank, self.refusal, self.detail = rank, refusal, detail
        super().__init__(f"rank {rank}: {message}")


class RunInterrupted(RuntimeError):
    """The launcher was asked to stop (SIGINT / SIGTERM); the ranks stopped."""

    def __init__(self, signum: int, detail: str = "") -> None:
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}{': ' + detail if detail else ''}")


def free_port() -> int:
    """A TCP port that was free a moment ago, for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun, else None."""
    if not all(name in os.environ for name in TORCHRUN_VARS):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def is_main_process() -> bool:
    """False only in a torchrun rank other than 0 (which prints nothing of its own)."""
    launched = torchrun_rank()
    return launched is None or launched[0] == 0


def init_data_parallel(rank: int, world_size: int, port: int | None, *, threads: int = 1) -> None:
    """gloo process group + megatron parallel state (tp = pp = cp = 1, dp = world size).

    ``port`` None: the rendezvous comes from the environment (torchrun's MASTER_ADDR/PORT).
    """
    from megatron.core import parallel_state

    from megatron_packing.megatron.cpu_workarounds import apply_cpu_workarounds

    torch.set_num_threads(threads)
    if port is not None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
    timeout = _timeout()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    # megatron's own groups (DP among them) take their timeout in minutes (a float works).
    minutes: Any = 30 if timeout is None else timeout.total_seconds() / 60
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=1,
                                             distributed_timeout_minutes=minutes)
    apply_cpu_workarounds()


def _timeout() -> datetime.timedelta | None:
    """The collectives' timeout from `TIMEOUT_ENV` (None: torch's default)."""
    value = os.environ.get(TIMEOUT_ENV, "")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {value!r}")
    return datetime.timedelta(seconds=seconds)


def shutdown_data_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _request_stop(signum: int, frame: Any) -> None:
    _stop_request["signal"] = _stop_request["signal"] or signum


def install_stop_handlers() -> None:
    """SIGINT / SIGTERM in a rank: ask to stop at the next step boundary instead of dying."""
    _stop_request["signal"] = 0
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _request_stop)


def agreed_stop_signal(group: dist.ProcessGroup | None = None) -> int:
    """The stop signal any rank received (0: none). Collective: call it on every rank."""
    flag = torch.tensor([_stop_request["signal"]], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


def _die_with_parent(parent_pid: int) -> None:
    """This rank and all it starts end when ``parent_pid`` (the launcher) ends."""
    process_lifetime.clear_parent_death_signal()
    process_lifetime.lead_process_group()
    process_lifetime.end_group_with_parent(parent_pid)


def _report_path(report_dir: str, rank: int) -> str:
    return os.path.join(report_dir, f"rank{rank}.json")


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, parent_pid: int,
           args: tuple, report_dir: str, refusals: tuple[type[BaseException], ...],
           faults: tuple[type[BaseException], ...]) -> None:
    """One spawned rank: a failure is written to its report file (read by the launcher) and
    ends the process with exit code 2 (a refusal) or 1 (a fault or a bug), never with a
    traceback of its own. The launcher's collapse of known third-party warnings holds here too
    (`quiet_start`)."""
    quiet_start.inherit()
    _die_with_parent(parent_pid)
    install_stop_handlers()
    code = 0
    try:
        init_data_parallel(rank, world_size, port)
        fn(rank, world_size, *args)
    except faults as exc:  # one message, which names where the details are
        _write_report(report_dir, rank, {"refusal": False, "message": str(exc)})
        code = 1
    except refusals as exc:
        _write_report(report_dir, rank, {"refusal": True, "message": str(exc)})
        code = 2
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a bug, even one outside Exception: the launcher shows it
        _write_report(report_dir, rank, {"refusal": False,
                                         "message": f"{type(exc).__name__}: {exc}",
                                         "traceback": traceback.format_exc()})
        code = 1
    finally:
        with contextlib.suppress(Exception):
            shutdown_data_parallel()
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip torch's own error reporting (a spawn traceback in the launcher)


def _write_report(report_dir: str, rank: int, report: dict[str, Any]) -> None:
    path = _report_path(report_dir, rank)
    with open(path + ".tmp", "w") as f:
        json.dump({**report, "time": time.time()}, f)
    os.replace(path + ".tmp", path)


def _first_failure(report_dir: str, codes: list[int | None]) -> RankFailed:
    """The failure that came first: a rank killed by a signal (it could not report; the others
    then lost their peer), else the earliest report."""
    world_size = len(codes)
    killed = [rank for rank, code in enumerate(codes) if code is not None and code < 0
              and not os.path.exists(_report_path(report_dir, rank))]
    if killed:
        name = signal.Signals(-int(codes[killed[0]] or 0)).name
        return RankFailed(killed[0], f"the rank process died (killed by {name}) without "
                          "reporting an error; the other ranks were stopped (the last complete "
                          "checkpoint is intact)", refusal=False)
    reports = []
    for rank in range(world_size):
        with contextlib.suppress(OSError, ValueError), open(_report_path(report_dir, rank)) as f:
            reports.append((json.load(f), rank))
    if reports:
        report, rank = min(reports, key=lambda item: item[0].get("time", 0.0))
        return RankFailed(rank, report["message"], refusal=bool(report["refusal"]),
                          detail=report.get("traceback", ""))
    rank, code = next((r, c) for r, c in enumerate(codes) if c not in (None, 0))
    return RankFailed(rank, f"the rank process died (exited with code {code}) without "
                      "reporting an error; the other ranks were stopped (the last complete "
                      "checkpoint is intact)", refusal=False)


def _has_exited(pid: int) -> bool:
    """Whether the child ``pid`` has exited, without reaping it (it stays a zombie)."""
    if not hasattr(os, "waitid"):
        return True  # no way to look without reaping: the caller reaps now
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class _Ranks:
    """The spawned ranks, reaped only once their process groups are killed.

    A rank's pid is its process group's id; until the rank is reaped no other process can take
    that pid, so killing the group then can only reach what the rank started.
    """

    def __init__(self, processes: list[Any]) -> None:
        self.processes = processes
        self.codes: dict[int, int | None] = {}

    def running(self) -> list[Any]:
        return [p for rank, p in enumerate(self.processes) if rank not in self.codes]

    def exit_codes(self) -> list[int | None]:
        """Each rank's exit code (None while it runs); an ended rank's group is killed first."""
        for rank, process in enumerate(self.processes):
            if rank not in self.codes and _has_exited(process.pid):
                process_lifetime.kill_process_group(process.pid)
                process.join()
                self.codes[rank] = process.exitcode
        return [self.codes.get(rank) for rank in range(len(self.processes))]

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every running rank (not to what it started)."""
        for process in self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)

    def kill_groups(self) -> None:
        """SIGKILL every running rank with its whole process group."""
        for process in self.running():
            process_lifetime.kill_process_group(process.pid)

    def kill(self) -> None:
        """Kill every rank with its whole process group and reap them."""
        self.kill_groups()
        deadline = time.monotonic() + 10
        while self.running() and time.monotonic() < deadline:
            self.exit_codes()
            time.sleep(0.05)


def spawn_data_parallel(fn: Callable[..., Any], world_size: int, *args: Any,
                        grace_s: float = 60.0,
                        refusals: tuple[type[BaseException], ...] = (),
                        faults: tuple[type[BaseException], ...] = ()) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; raise if any fails.

    ``fn`` must be importable by name (a module-level function). SIGINT / SIGTERM to this
    process asks the ranks to stop (see the module docstring) and raises `RunInterrupted`.
    A failed rank raises `RankFailed` once, for the first failure: ``refusals`` are the
    exception types that are a refusal of the input, ``faults`` those that are a fault whose
    message says all (no traceback); anything else is a bug. When this returns or raises, no
    rank and nothing a rank started is left.
    """
    with tempfile.TemporaryDirectory(prefix="megatron-packing-ranks-") as report_dir:
        _spawn(fn, world_size, args, grace_s, refusals, faults, report_dir)


def _spawn(fn: Callable[..., Any], world_size: int, args: tuple, grace_s: float,
           refusals: tuple[type[BaseException], ...], faults: tuple[type[BaseException], ...],
           report_dir: str) -> None:
    context = mp.start_processes(_entry, args=(fn, world_size, free_port(), os.getpid(), args,
                                               report_dir, refusals, faults),
                                 nprocs=world_size, join=False, start_method="spawn")
    ranks = _Ranks(context.processes)
    received: list[int] = []
    failure: RankFailed | None = None

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        if len(received) == 1:
            ranks.signal(signal.SIGTERM)
        else:
            ranks.kill_groups()

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
        if in_main_thread else {}
    try:
        deadline: float | None = None
        while True:
            alive = [p.sentinel for p in ranks.running()]
            if alive:
                multiprocessing.connection.wait(alive, timeout=0.5)
            codes = ranks.exit_codes()
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed and not received:  # the first failure; the others lost their peer
                time.sleep(0.5)  # let a rank that fails at the same moment write its report
                failure = _first_failure(report_dir, ranks.exit_codes())
                break
            if all(code is not None for code in codes) or (failed and received):
                break  # all done, or a rank stopped on purpose
            if received and deadline is None:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                ranks.kill_groups()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        ranks.kill()  # never leave a rank, or anything a rank started, behind
    if received:
        raise RunInterrupted(received[0])
    if failure is not None:
        raise failure


def run_as_torchrun_rank(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in this process, one rank of a torchrun launch."""
    launched = torchrun_rank()
    if launched is None:
        raise RuntimeError(f"not started by torchrun: {', '.join(TORCHRUN_VARS)} are not all set")
    rank, world_size = launched
    _die_with_parent(os.getppid())  # the torchrun agent
    install_stop_handlers()
    init_data_parallel(rank, world_size, None)
    try:
        fn(rank, world_size, *args)
    finally:
        shutdown_data_parallel()


def dp_group() -> dist.ProcessGroup:
    """Megatron's data-parallel group."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()
