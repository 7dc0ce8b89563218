"""While the job runs: stop signals passed on to the ranks, the exit verdict, restarts, and the
processes an attempt leaves behind.

Every process of one attempt inherits ``ATTEMPT_VARIABLE`` (the launcher's pid and the attempt's
number), so the launcher finds them on this machine whichever parent they were left with.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from hvdtrain.errors import (EXIT_PREEMPTED, EXIT_USAGE, RELAYED_STOP, UserError, signal_name,
                             stop_status)
from hvdtrain.launch.console import say
from hvdtrain.launch.failures import JobOutput, relay
from hvdtrain.launch.paths import Launch, command_line
from hvdtrain.launch.probe import ask
from hvdtrain.launch.remote import shell_on
from hvdtrain.launch.survivors import Survivors
from hvdtrain.launcher_env import Process, marked

FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
#: Pause between a failed attempt and the next, in seconds: long enough for the ports and GPU
#: memory of the dead ranks to be released, short next to the minutes a restart saves.
RESTART_DELAY_SECONDS = 3.0
#: Every process of one attempt inherits this variable (launcher pid and attempt number).
ATTEMPT_VARIABLE = "HVDTRAIN_LAUNCH_ATTEMPT"
#: Seconds a launch command (mpirun) may outlive its ranks on this host before the launcher
#: ends it: mpirun needs a moment to collect the exit statuses of every node.
ORPHANED_COMMAND_SECONDS = 30.0
#: Seconds rank 0's host has to answer whether rank 0 still runs (an ssh or srun start, then a
#: Python start-up); no answer by then counts as the host gone.
ASK_SECONDS = 30.0


@dataclass(frozen=True)
class Verdict:
    """How one attempt of the job ended, and whether starting it again can help."""

    restart: bool
    """True when the failure may not happen again (a rank was killed, crashed or lost a peer)."""
    reason: str
    """What the exit status means, for the launcher's one-line report."""


def judge_exit(status: int, stop_signal: int | None) -> Verdict:
    """The restart rule: which exit statuses of the job are worth another attempt."""
    if stop_signal is not None:
        # Someone asked the job to stop (Slurm's time-limit warning, scancel, Ctrl-C): it stops.
        # After SIGUSR1 the sbatch script requeues it, which restarts it with a fresh time limit.
        return Verdict(False, f"stopped on {signal_name(stop_signal)}")
    if status == 0:
        return Verdict(False, "finished")
    if status == EXIT_USAGE:
        return Verdict(False, "a user error: it would fail the same way again")
    if status == EXIT_PREEMPTED:
        return Verdict(False, "stopped for preemption after a checkpoint; requeue it to resume")
    if status in (128 + signal.SIGTERM, 128 + signal.SIGINT):
        # The ranks were told to stop (e.g. scancel signals every process of a step): a stop.
        return Verdict(False, f"stopped on {signal_name(status - 128)}")
    if status in (126, 127):  # the shell's "cannot execute" / "command not found"
        return Verdict(False, "the command could not be started")
    if 128 < status < 128 + signal.NSIG:
        return Verdict(True, f"a rank ended on {signal_name(status - 128)}")
    return Verdict(True, "a rank failed")


def attempt_processes(marker: str, whole: bool = True,
                      this_host_only: bool = False) -> dict[int, bool]:
    """This machine's processes of one attempt, {pid: is a rank}: those whose environment holds
    ``marker`` (set on the launch command, inherited by everything it starts); with ``whole``
    False, every attempt of one launcher (see launcher_env.marked)."""
    return {process.pid: process.rank is not None
            for process in marked(marker, prefix=not whole, this_host_only=this_host_only)}


@dataclass(frozen=True)
class RankZeroHost:
    """The host rank 0 runs on when it is not this one, and how to ask it about rank 0: a
    launcher whose own ranks have ended must not end a job whose rank 0 elsewhere is still
    writing its last checkpoint."""

    host: str
    python: str
    """The ranks' interpreter, which answers there (``hvdtrain.launch.probe ranks``)."""
    command: tuple[str, ...]
    """What runs a shell command line there (``remote.shell_on``: ssh, or an srun step)."""

    def rank_zero_runs(self, marker: str) -> bool | None:
        """True while rank 0 of the attempt runs there, False once it has ended, None when the
        host does not answer (down, or its link is)."""
        try:
            answer, _ = ask(self.python, ["ranks", marker], timeout=ASK_SECONDS, on=self.command,
                            env={**os.environ, "SLURM_CPUS_PER_TASK": "1"})
        except (OSError, subprocess.TimeoutExpired):
            return None
        return None if answer is None else 0 in answer["ranks"]


def rank_zero_host(hosts: list[str], local_names: set[str], python: str,
                   in_allocation: bool) -> RankZeroHost | None:
    """Where rank 0 runs (the first host: horovodrun, mpirun and srun all number the ranks in
    host order), unless that is this host, whose ranks the launcher sees itself."""
    first = hosts[0]
    if first in local_names:
        return None
    return RankZeroHost(first, python, shell_on(first, in_allocation))


def finishes_a_rank(process: Process) -> bool:
    """The helpers a rank leaves to finish after it: its scratch janitor (``python -m
    hvdtrain.scratch``) removes the rank's scratch directory and disk cache, its log tees
    (hvdtrain.ranklog) copy its last lines into its log. Each ends on its own at the end of
    file of a pipe that only the rank and its children hold."""
    return (process.argv[1:3] == ("-m", "hvdtrain.scratch")
            or os.path.basename(process.argv[0] if process.argv else "") == "tee")


def end_attempt(job_pid: int | None, marker: str, grace_seconds: float = 30, *,
                whole: bool = True) -> list[int]:
    """Kill what is left on this machine of a failed attempt (with ``whole`` False, of every
    attempt of one launcher); the pids still alive after ``grace_seconds`` of SIGKILL.
    ``job_pid``: the launch command's process group, killed first (None: not known).

    mpirun takes its ranks down with it when one dies, but a process it lost (a rank's child in
    a session of its own, a Gloo rank) would run on, beside the next attempt: in its allreduce,
    on its GPU, holding the run directory's lock. The ranks' finishers (finishes_a_rank) are
    killed only if they outlive everything else by ``grace_seconds``: killed with their rank,
    they would leave its scratch directory and disk cache on the node for good.
    """
    if job_pid is not None:
        try:
            os.killpg(job_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_seconds
    while (others := [process.pid for process in marked(marker, prefix=not whole)
                      if not finishes_a_rank(process)]) and time.monotonic() < deadline:
        signal_each((pid, signal.SIGKILL) for pid in others)
        time.sleep(0.1)
    if others:
        return others
    deadline = time.monotonic() + grace_seconds  # the finishers' pipes are closed now
    while (finishers := [process.pid for process in marked(marker, prefix=not whole)]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_each((pid, signal.SIGKILL) for pid in finishers)  # stuck: not worth a restart
    return []


def signal_each(targets) -> None:
    """``os.kill`` each ``(pid, signal)``; a process already gone is no error (a job's processes
    exit on their own while they are being signalled)."""
    for pid, signum in targets:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def stop_job(job: dict[int, bool], signum: int, command_group: int | None = None) -> None:
    """Pass a stop signal on to a running job: ``job`` is its processes on this host ({pid: is a
    rank}, see attempt_processes); the commands among them (mpirun, srun, horovodrun) are
    reached through their process group ``command_group`` when given, one by one otherwise.

    SIGUSR1 goes everywhere as it is: mpirun and srun forward it to every rank on every node.
    SIGTERM and SIGINT reach the commands as RELAYED_STOP (mpirun would abort the job on them and
    SIGKILL the ranks 2 s later, mid-checkpoint) and the ranks here as SIGTERM (a rank stops on
    either the same way; the launcher still exits 130 after SIGINT). The ranks here are
    signalled directly as well: horovodrun --gloo starts each in a session of its own, out of the
    group's reach (twice is harmless: a rank's handler records).
    """
    plain = signum == signal.SIGUSR1
    to_ranks, to_commands = (signum, signum) if plain else (signal.SIGTERM, RELAYED_STOP)
    if command_group is not None:
        targets = [(-command_group, to_commands)]
    else:
        targets = [(pid, to_commands) for pid, is_rank in job.items() if not is_rank]
    targets += [(pid, to_ranks) for pid, is_rank in job.items() if is_rank]
    signal_each(targets)


def kill_children() -> None:
    """SIGKILL this process's direct children. Before the ranks start they are the launcher's
    checks (a probe), and one started just as a stop signal came (the signal raised inside
    subprocess's start, before it returned the process to be ended) has no one else to end it."""
    me = os.getpid()
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:  # "PID (name) STATE PPID ..."
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == me:
            children.append((int(entry), signal.SIGKILL))
    signal_each(children)


class StoppedBeforeLaunch(BaseException):
    """SIGINT or SIGTERM arrived before anything was launched (the checks before it, such as
    the preflight probe, a child that Ctrl-C interrupts too): raised by the signal handler, so
    the launcher stops at once with the signal's exit status, as KeyboardInterrupt would.
    SIGUSR1 is only recorded: the launcher then exits 75 without starting the ranks, which an
    sbatch script answers with a requeue."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class SignalForwarder:
    """SIGUSR1/SIGTERM/SIGINT sent to the launcher: recorded from the moment it starts, and
    passed on to the processes of what is running (the health check, an attempt of the job);
    before anything is launched SIGTERM and SIGINT stop it at once (StoppedBeforeLaunch)."""

    def __init__(self):
        self.received: list[int] = []
        self._launched = False
        self._stopping = False
        self._job_pid: int | None = None
        self._marker = ""
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, self._receive)

    def _receive(self, signum, frame):
        self.received.append(signum)
        if self._job_pid is not None:
            stop_job(attempt_processes(self._marker), signum, command_group=self._job_pid)
        elif not self._launched and signum != signal.SIGUSR1 and not self._stopping:
            # Once: a second Ctrl-C must not cut short the cleanup the first one started (the
            # network check's probes, the preflight probe), which then ends the launcher.
            self._stopping = True
            raise StoppedBeforeLaunch(signum)

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None

    def start(self, launch: Launch, marker: str, **popen_options) -> subprocess.Popen | None:
        """Start the command in its own process group, or None if a stop signal came first.
        Its stdout and stderr are pipes, unless ``popen_options`` (Popen's) say otherwise."""
        def prepare_child():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
            # horovodrun execs `/bin/sh -c mpirun ...`; a shell that starts with a signal ignored
            # keeps ignoring it, so the group signal stops at mpirun (which forwards it to every
            # rank, on every node) instead of killing the shell, and the launcher waits until
            # the ranks have checkpointed and mpirun is done. mpirun, srun and the Python ranks
            # install their own handlers.
            for signum in (*FORWARDED_SIGNALS, RELAYED_STOP):
                signal.signal(signum, signal.SIG_IGN)

        # A signal between the check and Popen would be recorded but reach no rank: hold signals
        # until the job is known, so each one is either "before the start" or forwarded.
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
        try:
            self._launched = True
            if self.received:
                return None
            name, value = marker.split("=", 1)
            # Its output comes through the launcher (see relay_output), which reads why it failed.
            process = subprocess.Popen(launch.argv, env={**os.environ, **launch.env, name: value},
                                       start_new_session=True, preexec_fn=prepare_child,
                                       **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE,
                                          **popen_options})
            self._job_pid, self._marker = process.pid, marker
            return process
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)

    def ended(self) -> None:
        """What was started has ended: a signal from now on is only recorded."""
        self._job_pid = None

    def wait(self, process: subprocess.Popen, rank_zero: RankZeroHost | None = None,
             startup: StartupDeadline | None = None) -> int:
        """The job's exit status (128 + N when it ended on signal N)."""
        returncode = wait_for_job(process, self._marker, rank_zero, startup=startup)
        self.ended()
        status = returncode if returncode >= 0 else 128 - returncode
        if status and self.received:
            # The ranks stopped on the forwarded signal (75 or 143, checkpoint written), but the
            # command reports its own status for that (Gloo's horovodrun: 1 for any failure;
            # mpirun: 1 after a SIGTERM); give the sbatch script the one it acts on.
            stop = stop_status(self.received[0])
            if status != stop:
                say(f"the ranks stopped on {signal_name(self.received[0])}; exiting {stop}"
                    + (" so the job is requeued" if stop == EXIT_PREEMPTED else ""))
            return stop
        return status

    def pause(self, seconds: float) -> bool:
        """Sleep, but return early (True) when a stop signal arrives."""
        deadline = time.monotonic() + seconds
        while not self.received and time.monotonic() < deadline:
            time.sleep(0.05)
        return bool(self.received)


@dataclass
class StartupDeadline:
    """--startup-timeout: how long the launch command may run on rank 0's host (this one)
    before a rank of its has started here.

    mpirun starts no rank anywhere until its daemon on every node has reported back. A daemon
    that never starts (a node down or unreachable; inside Slurm, its srun step waiting behind
    another step of the job that holds that node's CPUs) leaves the job RUNNING without a word:
    Open MPI sends the srun messages of its daemons to /dev/null. A rank is a process here as
    soon as it is forked (before Python imports anything), so this waits on the launch's wire-up
    alone, not on TensorFlow's import or a container's start."""

    seconds: float
    missed_by: str | None = None
    """The command that never started a rank, once the deadline has passed."""

    def explained(self) -> str:
        return (f"no rank started within {self.seconds:g} s: {self.missed_by} starts the ranks "
                "only once it has reached every node, and it did not reach one (a node down or "
                "unreachable; in Slurm, another step of this job holding a node's CPUs, e.g. an "
                "srun without --overlap left running: squeue --steps lists them)")


def wait_for_job(process: subprocess.Popen, marker: str, rank_zero: RankZeroHost | None = None,
                 grace_seconds: float = ORPHANED_COMMAND_SECONDS,
                 startup: StartupDeadline | None = None) -> int:
    """The command's return code, once it ended; or 1 after ending a command that would wait
    forever for a node that is gone, or (``startup``, on rank 0's host) that started no rank
    here in time.

    mpirun, once a rank failed, tells the daemons of every node to end theirs and waits for
    their answers. A node whose network link went down never answers (TCP retries for ~15
    minutes), so mpirun would hang long after every rank it could reach has ended. Watched here:
    this host's ranks all ended, the command still runs ``grace_seconds`` later, and rank 0 has
    ended too (here, or on its own host, asked with ``rank_zero``) or its host does not answer:
    then the launcher ends the command. While rank 0 runs elsewhere (its last checkpoint, the
    export) the job is healthy and the launcher waits.
    """
    ranks_seen, ranks_gone_since, waiting_said = False, None, False
    started = time.monotonic()
    while True:
        try:
            return process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        ranks_here = any(attempt_processes(marker, this_host_only=True).values())
        ranks_seen = ranks_seen or ranks_here
        if (not ranks_seen and startup is not None and rank_zero is None
                and time.monotonic() - started > startup.seconds):
            startup.missed_by = os.path.basename(process.args[0])
            return end_command(process)
        if not ranks_seen or ranks_here:
            ranks_gone_since = None
            continue
        ranks_gone_since = ranks_gone_since or time.monotonic()
        if time.monotonic() - ranks_gone_since < grace_seconds:
            continue
        if rank_zero is None:
            why = "rank 0 ended with them"
        else:
            runs = rank_zero.rank_zero_runs(marker)
            if runs and process.poll() is None:
                if not waiting_said:
                    say(f"the ranks on this host ended; rank 0 still runs on {rank_zero.host}: "
                        "waiting for it")
                    waiting_said = True
                ranks_gone_since = time.monotonic()  # ask again after another grace period
                continue
            if process.poll() is not None:
                continue  # it ended while the host was asked
            why = (f"rank 0 on {rank_zero.host} ended" if runs is False
                   else f"{rank_zero.host}, rank 0's host, does not answer")
        say(f"the ranks on this host ended {grace_seconds:g} s ago and {why}, but "
            f"{process.args[0]} still waits for another node (unreachable?); ending it")
        return end_command(process)


def end_command(process: subprocess.Popen) -> int:
    """End the launch command's process group (SIGTERM, SIGKILL 5 s later); 1."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass
    return 1


def relay_output(process: subprocess.Popen, output: JobOutput,
                 logs_dir: str | None) -> list[threading.Thread]:
    """Copy the job's stdout and stderr to the launcher's own, reading each line into
    ``output`` (``logs_dir``: where the ranks' logs are, named if the launcher's fail)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # said by the relay, on its first line
            pass
    return [relay(process.stdout, sys.stdout.buffer, output, "stdout", logs_dir),
            relay(process.stderr, sys.stderr.buffer, output, "stderr", logs_dir)]


def finish_relays(relays: list[threading.Thread], seconds: float = 5.0) -> None:
    """Let the relays copy the job's last lines: they end when every writer of the pipes has
    (a process the job left on another host may hold one: not waited for beyond ``seconds``)."""
    deadline = time.monotonic() + seconds
    for thread in relays:
        thread.join(max(0.0, deadline - time.monotonic()))


def run_attempts(launch: Launch, max_restarts: int, signals: SignalForwarder,
                 rank_zero: RankZeroHost | None = None, logs_dir: str | None = None,
                 survivors: Survivors | None = None, startup_seconds: float = 0) -> int:
    """Run the job; after a failure worth another attempt, run it again, up to ``max_restarts``
    times. The exit status is the last attempt's. ``rank_zero``: rank 0's host, when not this
    one (see wait_for_job); ``logs_dir``: where the ranks keep their logs, named when it fails;
    ``survivors`` (--min-nodes): before a restart, the hosts that stopped answering are dropped
    (its ``rebuild`` gives the launch and rank 0's host for the rest); ``startup_seconds``: see
    StartupDeadline (0: no deadline)."""
    restarts = 0
    while True:
        marker = f"{ATTEMPT_VARIABLE}={os.getpid()}.{restarts}"
        process = signals.start(launch, marker)
        if process is None:
            say(f"{signal_name(signals.first)} before the ranks started; not starting them")
            return stop_status(signals.first)
        if not restarts:
            say(command_line(launch))
        output = JobOutput()
        relays = relay_output(process, output, logs_dir)
        startup = StartupDeadline(startup_seconds) if startup_seconds else None
        status = signals.wait(process, rank_zero, startup)
        if status == 0:
            finish_relays(relays)
            return status
        left = end_attempt(process.pid, marker)
        finish_relays(relays)
        if left:
            say(f"process(es) {' '.join(map(str, left))} of the failed job would not exit")
        verdict = judge_exit(status, signals.first)
        ended = f"job exited {status} ({verdict.reason})"
        if verdict.restart:
            # One line for the whole failure, whatever the job's size: what its output said
            # (see failures.py), or at least where each rank's log is (a rank that was killed
            # may have said nothing on the console; its log has what it printed, on any node).
            logs = logs_dir if logs_dir and os.path.isdir(logs_dir) else None
            said = startup.explained() if startup and startup.missed_by else output.verdict(logs)
            if said:
                ended = f"job exited {status}: {said}"
            elif logs:
                ended += f"; every rank's output: {os.path.join(logs, 'rank-<K>.log')}"
        if not max_restarts:
            # A failed job's last line (failures.py keeps mpirun's own pages back); a job stopped
            # by a signal to the launcher has said so already (SignalForwarder.wait, the ranks).
            if signals.first is None:
                say(ended)
            return status
        if not verdict.restart:
            say(f"{ended}; not restarting")
            return status
        if restarts == max_restarts:
            say(f"{ended}; no restarts left (--max-restarts {max_restarts})")
            return status
        if left:  # they would compete with the new ranks for the GPUs and the run directory
            say(f"{ended}; not restarting beside processes of the failed attempt")
            return status
        where = ""
        if survivors is not None:
            try:
                shrunk = survivors.after_failure()
            except UserError as error:
                say(f"{ended}; {error}")
                return status
            if shrunk is not None:
                (launch, rank_zero), words = shrunk
                where = f" {words}"
        restarts += 1
        say(f"{ended}; restart {restarts} of {max_restarts}{where} in {RESTART_DELAY_SECONDS:g} s "
            "(an hvdtrain job resumes from its last checkpoint)")
        if signals.pause(RESTART_DELAY_SECONDS):
            say(f"{signal_name(signals.first)} before the restart; not restarting")
            return stop_status(signals.first)
