"""Preemption, end to end: a stop signal is caught, agreed on by all ranks, checkpointed, and
turned into the exit status the Slurm templates answer.

Slurm sends ``--signal=B:USR1@<seconds>`` before a job's time limit and SIGTERM when it is
cancelled or preempted; the templates and ``hvdtrain.launch`` forward both to every rank. The
path through this module:

1. ``StopSignals`` records the signal on whichever rank got it (never fatal);
2. ``PreemptionCheck`` makes all ranks agree on it at the same step, leave ``fit`` together, and
   has rank 0 write a checkpoint at once (``on_stop``: ``checkpoint.SaveOnStop``);
3. ``hvdtrain.errors.stop_status`` says how the job ends: 75 (``EXIT_PREEMPTED``: requeue me)
   after SIGUSR1, 128 + N after any other signal, as if it had killed the process.
"""
from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import Callable

import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

from hvdtrain.errors import RELAYED_STOP, signal_name


@dataclass
class StopRequest:
    """A stop signal as this rank saw it, and as all ranks agreed on it."""

    received: int = 0
    """Signal number this rank caught (0: none yet)."""
    agreed: int = 0
    """Signal number all ranks agreed to stop on, at the same step (0: keep training)."""
    epoch: int | None = None
    """The epoch in which training stopped."""
    mid_epoch: bool = False
    """True when steps of that epoch were left undone (a resume goes on at its step, or re-runs
    it: checkpoint.restore_or_start)."""
    saved: bool = False
    """Rank 0 already wrote the checkpoint for this stop."""
    steps_before: int = 0
    """Steps of the current epoch run before this ``fit`` (a run resumed inside the epoch)."""
    job_asked: bool = False
    """The job's callbacks asked this rank to stop; not agreed on yet."""
    by_job: bool = False
    """The ranks agreed to stop because the job's own callbacks asked to (EarlyStopping,
    TerminateOnNaN, ...), on some rank: the run ends there, exit 0, no requeue."""


class StopSignals:
    """Records SIGUSR1 and SIGTERM (or the launcher's SIGUSR2 for it) from the start of a run to
    its end, instead of dying of them.

    Slurm sends ``--signal=B:USR1@<seconds>`` before the time limit (the sbatch templates forward
    it to the ranks). Installed for the whole run, not just ``fit``: a signal that arrives while
    the data is listed or the model exported must not kill a rank either.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, RELAYED_STOP)

    def __init__(self, rank: int, request: StopRequest):
        self.rank = rank
        self.request = request
        self._previous = {}

    def __enter__(self) -> StopSignals:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum, frame) -> None:
        if signum == RELAYED_STOP:
            # A rank on the launcher's host gets the signal itself too (SIGTERM, or SIGINT):
            # the stand-in adds nothing to it.
            if self.request.received:
                return
            self._note(signal.SIGTERM, " (the launcher's SIGTERM, through mpirun)")
        else:
            self._note(signum, "")

    def _note(self, signum: int, how: str) -> None:
        if not self.request.received:
            print(f"rank {self.rank}: caught {signal_name(signum)}{how}; stopping after the "
                  "current step to write a checkpoint", file=sys.stderr, flush=True)
        self.request.received = signum


class PreemptionCheck(keras.callbacks.Callback):
    """Stop all ranks at the same step when any rank caught a stop signal, or when the job's own
    callbacks asked one rank to stop (``model.stop_training``).

    Every ``check_every`` batches the ranks agree on ``request.received`` with one small
    collective, so they all leave ``fit`` after the same step and no rank is left waiting in an
    allreduce. On agreement ``on_stop(epoch, mid_epoch, steps done in the epoch)`` runs at once
    (rank 0 writes the checkpoint there, before Keras' end-of-epoch validation eats into Slurm's
    warning time).

    Last of the callbacks, so it sees what the job's callbacks decided: Keras leaves ``fit`` as
    soon as ``stop_training`` is set, so a stop set on one rank in a batch is held back here and
    agreed on at the next check (the same collective carries it); with ``agree_at_epoch_end``
    the ranks also agree once per epoch on a stop set at the epoch's end (a callback reading
    rank-local state may decide differently on different ranks).
    """

    def __init__(self, runtime, request: StopRequest, check_every: int,
                 on_stop: Callable[[int, bool, int], None], agree_at_epoch_end: bool = False):
        super().__init__()
        # Reads no metrics per batch: Keras then need not copy them out of the step every batch.
        self._supports_tf_logs = True
        self.runtime = runtime
        self.request = request
        self.check_every = check_every
        self.on_stop = on_stop
        self.agree_at_epoch_end = agree_at_epoch_end
        self.next_check = check_every

    def on_epoch_begin(self, epoch, logs=None):
        self.request.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.model.stop_training and not self.request.agreed and not self.request.by_job:
            # Held back until the ranks agree (below): this rank alone leaving fit would leave
            # the others in the next allreduce.
            self.request.job_asked, self.model.stop_training = True, False
        # Counted in batches, not calls: with steps_per_execution one call covers many batches.
        # Every rank sees the same batch numbers, so every rank checks at the same steps.
        steps = self.params["steps"]
        done = self.request.epoch * steps + batch + 1
        if done < self.next_check:
            return
        self.next_check = done + self.check_every
        # One collective for both: the largest signal caught (x2), or 1 when only a job asked.
        agreed = self.runtime.max_over_ranks(self.request.received * 2 + self.request.job_asked)
        if agreed >= 2:
            self.request.agreed = agreed // 2
            self.request.mid_epoch = batch + 1 < steps
            self.model.stop_training = True
            self.on_stop(self.request.epoch, self.request.mid_epoch,
                         self.request.steps_before + batch + 1)
        elif agreed:
            self.request.by_job = True
            self.request.mid_epoch = batch + 1 < steps
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if not self.agree_at_epoch_end or self.request.agreed or self.request.by_job:
            return
        asked = bool(self.model.stop_training or self.request.job_asked)
        if self.runtime.max_over_ranks(int(asked)):
            self.request.by_job = True
            self.model.stop_training = True


def describe_stop(request: StopRequest) -> str:
    return (f"stopped by {signal_name(request.agreed)} in epoch {request.epoch + 1}; "
            "checkpoint written, rerun to resume")
