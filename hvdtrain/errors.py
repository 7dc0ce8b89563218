"""How hvdtrain fails: one clear line, printed once, a non-zero exit, never a traceback wall.

Every rank of a data-parallel job runs the same code on the same inputs, so most mistakes (a missing
data directory, a bad flag) are found by every rank at the same moment. Those raise ``UserError``:
rank 0 prints the one line and every rank exits 2 together, so no rank is left waiting in a
collective. A mistake that only one rank can see (its GPU is missing) raises ``RankError``, which
that rank prints with its rank number.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import sys
import time
import traceback
from typing import Callable, Iterator

from hvdtrain import ranklog
from hvdtrain.launcher_env import launch_rank

#: Exit status for bad input or environment (argparse's convention).
EXIT_USAGE = 2
#: Exit status for "stopped on a preemption signal, checkpoint written, run me again" (EX_TEMPFAIL).
EXIT_PREEMPTED = 75
#: SIGTERM or SIGINT as the launcher passes it through mpirun, which would take either as "abort
#: the job" and SIGKILL every rank 2 s later (odls_base_sigkill_timeout: SIGCONT, 1 s, SIGTERM,
#: 1 s, SIGKILL), in the middle of the checkpoint; SIGUSR2 it forwards to every rank of every
#: node unchanged. A rank takes it for SIGTERM.
RELAYED_STOP = signal.SIGUSR2



def checkout_top() -> str | None:
    """The repository this hvdtrain runs from (the directory above the package, when it holds
    scripts/install.sh), or None for a pip-installed package."""
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return top if os.path.isfile(os.path.join(top, "scripts", "install.sh")) else None


def rebuild_the_stack() -> str:
    """How to (re)build horovod against this Python's TensorFlow, for a message's remedy: in
    hvdtrain's checkout `make install`; a pip-installed hvdtrain has no install script beside it."""
    if checkout_top():
        return "run `make install`"
    return ("build it from a checkout of hvdtrain's repository against this Python's TensorFlow: "
            "HVDTRAIN_STACK=existing PYTHON=python bash scripts/install.sh (docs/install.md)")


def stop_status(signum: int) -> int:
    """How a job ends after a stop signal, the one rule the ranks and the launcher both apply:
    SIGUSR1 (Slurm's warning before the time limit) asks to be run again, so 75
    (``EXIT_PREEMPTED``), which the launcher answers with ``scontrol requeue``; any other signal
    is a plain stop, 128 + N as if it had killed the process."""
    return EXIT_PREEMPTED if signum == signal.SIGUSR1 else 128 + signum


def signal_name(number: int) -> str:
    """SIGUSR1 for 10; real-time signals other than SIGRTMIN/SIGRTMAX have no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


#: What horovod's collectives raise on every rank once horovod has shut down.
HOROVOD_SHUT_DOWN = "Horovod has been shut down"

# Two failures every rank reaches at the same moment. Each line is written here and read back by
# the launcher (hvdtrain.launch.failures), which says what rank 0's line says in its end line.
SHUT_DOWN_REPORT = re.compile(r": rank (\d+): horovod shut the job down")
NO_STEP_REPORT = re.compile(r"hvdtrain: rank (\d+) on (\S+): no training step finished in "
                            r"([\d.]+) s")


def shut_down_report(program: str, rank: int, log: str | None) -> str:
    return (f"{program}: rank {rank}: horovod shut the job down: a rank failed (its error is "
            "above) or stalled in a collective past the stall limit "
            f"(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS){_its_log(log)}")


def no_step_report(rank: int, host: str, seconds: float, log: str | None) -> str:
    return (f"hvdtrain: rank {rank} on {host}: no training step finished in {seconds:g} s: a "
            "peer stopped answering (a node or its network link down?); ending this rank so "
            f"that the job ends{_its_log(log)}")


def _its_log(log: str | None) -> str:
    return f"; its log: {log}" if log else ""


#: How long the other ranks give rank 0 to print a report they all reached, before they exit.
REPORT_GRACE_SECONDS = 2.0


def report_once(line: str, rank: int) -> None:
    """A failure every rank reports at the same moment, printed once: by rank 0, while each
    other rank writes it only into its own log (64 ranks, one line; each log still says what
    its rank saw). The first rank to exit makes mpirun end the others, so the other ranks wait
    ``REPORT_GRACE_SECONDS`` first: rank 0 may see the failure a moment later (its stall
    watchdog looks once a second) and must not be ended before its line is out."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    else:
        ranklog.note(line)
        time.sleep(REPORT_GRACE_SECONDS)


class UserError(Exception):
    """A mistake in the user's input or environment, the same on every rank. One line, exit 2."""


class RankError(UserError):
    """A mistake only this rank can see (its own GPU, its own shard). Printed by this rank."""


def as_one_line(error: BaseException, limit: int = 300) -> str:
    """``Type: message`` with the message's lines joined, cut at ``limit`` characters: for a
    message Keras wraps over several lines, whose first line alone says nothing."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type's name when it has none.

    TensorFlow and horovod errors run to many lines; a one-line report quotes only the first.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and lines[0] == "Graph execution error:":
        # TensorFlow's wrapper around an op's error: after it comes the Python stack where the
        # op was defined, indented, then the op's own message (the line worth quoting).
        said = [line for line in str(error).splitlines()[1:]
                if line.strip() and not line[0].isspace() and not line.startswith("Detected at")]
        return said[0].strip() if said else lines[0]
    return lines[0] if lines else type(error).__name__



def op_error_line(error: BaseException) -> str:
    """``first_line`` of a TensorFlow op's error without the internal names it wraps it in
    (``{{function_node ...}}``, `` [Op:Name] name:``)."""
    return re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\].*$", "", first_line(error))

def leave(status: int) -> None:
    """Exit with ``status``. Once TensorFlow is loaded, without Python's finalization: a tf.data
    iterator freed with the exception that ended the run waits, holding the GIL, for its worker
    threads, and a worker inside a ``py_function`` (the disk store's writes) waits for the GIL:
    that hung 1 exit in 5 of a rank whose disk filled up under load. The exit handlers (the
    scratch directory's removal, horovod's shutdown) still run, and what was printed is flushed."""
    if "tensorflow" not in sys.modules:
        sys.exit(status)
    atexit._run_exitfuncs()  # what sys.exit would run; CPython's, as the interpreter calls it
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


@contextlib.contextmanager
def reported(program: str, rank: Callable[[], int] = launch_rank) -> Iterator[None]:
    """Turn exceptions into the project's failure contract (see module docstring).

    ``rank`` is asked only when something fails, so it can report the runtime's rank once the
    runtime is up and the launcher's before that.
    """
    try:
        yield
    except RankError as error:
        print(f"{program}: error on rank {rank()}: {error}", file=sys.stderr, flush=True)
        leave(EXIT_USAGE)
    except UserError as error:
        # Rank 0 prints; the others give it the grace to do so before their exit makes mpirun
        # end it (seen under load: rank 1 exited first and the line was never printed).
        report_once(f"{program}: error: {error}", rank())
        leave(EXIT_USAGE)
    except KeyboardInterrupt:
        leave(130)
    except Exception as error:  # a bug: rank 0 shows where, the others one line each
        this_rank = rank()
        # A rank's log keeps what it printed before failing (on its node, after the launcher
        # and its terminal are gone): every failure line names it.
        log = ranklog.current()
        its_log = _its_log(log)
        if HOROVOD_SHUT_DOWN in str(error):
            # Horovod ends every rank's pending collective with this when a rank failed or
            # stalled past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: every rank reaches it together.
            report_once(shut_down_report(program, this_rank, log), this_rank)
            leave(1)
        if this_rank == 0 or os.environ.get("HVDTRAIN_TRACEBACKS") == "all":
            traceback.print_exc()
            if log:
                print(f"{program}: rank {this_rank} failed{its_log}", file=sys.stderr, flush=True)
        else:
            print(f"{program}: rank {this_rank} failed: {type(error).__name__}: "
                  f"{first_line(error)}{its_log} (HVDTRAIN_TRACEBACKS=all shows every rank's "
                  "traceback)", file=sys.stderr, flush=True)
        leave(1)
