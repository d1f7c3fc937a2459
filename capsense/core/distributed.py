"""The processes of one run: rank, world size, device per process, barrier, exchange.

Launched by ``accelerate launch`` (or ``torchrun``, which accelerate runs underneath), each
process finds ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` in its environment and joins the
process group (NCCL on GPUs, gloo on CPUs), unless accelerate's ``PartialState`` already
did. A plain ``python -m capsense`` is a world of one and never touches
``torch.distributed``. Every process runs the same deterministic code; only the
evaluation of masks is split, and only the main process writes the run folder's outputs.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from capsense.errors import CapsenseError

T = TypeVar("T")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(frozen=True)
class DistContext:
    """This process's place in the run: ``rank`` of ``world`` (``local_rank`` on its machine)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        """Wait until every process gets here."""
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: T) -> list[T]:
        """Every process's ``obj``, in rank order, on every process."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """The main process's ``obj`` on every process."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the main process only and hand its result to all; if it raised, raise
        the same error on every process (so none is left waiting at a barrier)."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except Exception as e:  # re-raised below, on every process
                error = e
        if self.distributed:
            result, error = self.broadcast((result, _picklable(error)))
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    def device(self, requested: str) -> str:
        """The device this process uses for ``requested``: under several processes, each
        takes its own GPU (``cuda`` -> ``cuda:<local_rank>``); ``cpu`` stays ``cpu``."""
        if self.distributed and requested.startswith("cuda"):
            return f"cuda:{self.local_rank}"
        return requested


def _picklable(error: Exception | None) -> Exception | None:
    if error is None:
        return None
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return CapsenseError(f"{type(error).__name__} on the main process: {error}")


_CONTEXT: DistContext | None = None


def _leave_group() -> None:
    """Destroy the process group this module joined, at exit while the interpreter is whole.

    Left to interpreter shutdown, gloo's worker threads can outlive the objects they hold and
    the process dies with ``terminate called without an active exception`` (SIGABRT) after a
    run that succeeded; CI saw it once on a two-process CPU ``locate`` (pytorch/pytorch#190489
    reports the same). Every process has finished its collectives when it exits, so the
    destruction is local. It did not end the abort (2 of 40 looped runs still
    aborted): the command line ends through :func:`finish` and never gets here; this hook
    stays for Python callers that end their script as usual.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def finish(code: object) -> None:
    """End this process with exit status ``code`` without interpreter shutdown, if it is one of
    several processes of a launch in a process group (capsense's, or the one accelerate's state
    made for lm-eval); return (and let the caller exit as usual) otherwise.

    Destroying the group at exit (:func:`_leave_group`) was not enough: 2 of 40 two-process CPU
    ``locate`` runs in a loop still died with ``terminate called without an active exception``
    (SIGABRT) after the run had written everything and printed its report, once on rank 0 and
    once on rank 1; Python's faulthandler showed one thread and no Python frame left, so the
    abort comes from native teardown after the interpreter finished, which no Python code can
    order. Skipping that teardown is what ends it: after a success every process waits at a
    barrier (no message is in flight when the sockets close), then streams and log handlers are
    flushed and the process ends with ``os._exit``. After a failure it ends at once (the
    launcher stops the others). The command's files are closed by then: every write in capsense
    goes through a ``with`` block or an atomic rename.
    """
    import logging
    import sys

    dist = sys.modules.get("torch.distributed")  # never imports torch: no group without it
    if _env_int("WORLD_SIZE", 1) <= 1 or dist is None or not dist.is_available() or not dist.is_initialized():
        return

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # SystemExit("message"): Python prints the message and exits with 1
        print(code, file=sys.stderr)
        status = 1
    if status == 0:
        try:
            dist.barrier()
        except Exception as e:  # a peer already gone: the launcher reports the failure
            print(f"capsense (process {_env_int('RANK', 0)}): the closing barrier failed: {e}", file=sys.stderr)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing left to flush
            pass
    os._exit(status)


def context() -> DistContext:
    """This process's :class:`DistContext`, joining the process group on first use if launched
    as one of several processes."""
    global _CONTEXT
    if _CONTEXT is not None:
        return _CONTEXT
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        _CONTEXT = DistContext()
        return _CONTEXT
    import torch
    import torch.distributed as dist

    local_rank = _env_int("LOCAL_RANK", 0)
    if not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and os.environ.get("CAPSENSE_DIST_BACKEND", "") != "gloo"
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        atexit.register(_leave_group)
    _CONTEXT = DistContext(
        rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank,
        local_world=_env_int("LOCAL_WORLD_SIZE", dist.get_world_size()),
    )
    return _CONTEXT


def split(items: list[T], ctx: DistContext) -> list[list[T]]:
    """``items`` cut into ``ctx.world`` contiguous shares, in rank order (sizes differ by at most 1)."""
    n, w = len(items), ctx.world
    bounds = [r * n // w for r in range(w + 1)]
    return [items[bounds[r] : bounds[r + 1]] for r in range(w)]


def quiet_exit(message: str, grace_s: float = 10.0) -> None:
    """End a process other than the main one after an error, leaving the message to the main process.

    Bad input fails the same way on every process; the main process says so once and exits,
    and the launcher then stops the others. Should the main process carry on (an error of
    this process alone), this one says it after ``grace_s`` and exits.
    """
    import sys
    import time

    time.sleep(grace_s)
    print(f"Error (process {context().rank}): {message}", file=sys.stderr)
    raise SystemExit(1)


def is_main_process() -> bool:
    """Whether this is the main process of a launch (rank 0), read from the environment without
    joining any process group (lm-eval's own data parallel does that)."""
    return _env_int("RANK", 0) == 0
