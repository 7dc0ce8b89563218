"""A job whose ranks take 4 s to stop after a stop signal (a slow last checkpoint), for the
launcher's signal tests (run as a script by hvdtrain.launch).

    python slow_stop.py RECORD

Every rank appends "started rank=<rank>" to RECORD, then "rank=<rank> got <SIGNAME>" for each
SIGTERM or SIGUSR2 it receives, and "stopped rank=<rank>" 4 s after the first, before it exits
143. Without a signal it ends after 120 s.
"""
import os
import signal
import sys
import time

record_path = sys.argv[1]
rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0"))
first_signal_at = []


def note(line: str) -> None:
    with open(record_path, "a") as record:
        record.write(line + "\n")


def on_signal(signum, frame):
    note(f"rank={rank} got {signal.Signals(signum).name}")
    first_signal_at.append(time.monotonic())


for signum in (signal.SIGTERM, signal.SIGUSR2):
    signal.signal(signum, on_signal)
note(f"started rank={rank}")
deadline = time.monotonic() + 120
while time.monotonic() < deadline and not (first_signal_at
                                           and time.monotonic() > first_signal_at[0] + 4):
    time.sleep(0.05)
note(f"stopped rank={rank}")
sys.exit(143 if first_signal_at else 0)
