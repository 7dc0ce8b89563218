"""A rank's side of a stop signal (hvdtrain.training.preemption.StopSignals): what it records for each
signal, real signals sent to this process. The launcher's side, with real mpirun and ranks, is
in test_restarts.py."""
from __future__ import annotations

import os
import signal

from hvdtrain.errors import RELAYED_STOP
from hvdtrain.training.preemption import StopRequest, StopSignals


def received_after(*signals: int) -> int:
    request = StopRequest()
    with StopSignals(rank=0, request=request):
        for signum in signals:
            os.kill(os.getpid(), signum)  # Python runs the handler before the next bytecode
    return request.received


def test_the_launchers_stand_in_for_sigterm_is_a_sigterm():
    assert received_after(RELAYED_STOP) == signal.SIGTERM


def test_the_stand_in_adds_nothing_to_a_signal_already_caught():
    assert received_after(signal.SIGUSR1, RELAYED_STOP) == signal.SIGUSR1
    assert received_after(signal.SIGTERM, RELAYED_STOP) == signal.SIGTERM


def test_the_handlers_before_are_back_afterwards():
    before = {signum: signal.getsignal(signum) for signum in StopSignals.SIGNALS}
    received_after(signal.SIGUSR1)
    assert {signum: signal.getsignal(signum) for signum in StopSignals.SIGNALS} == before
