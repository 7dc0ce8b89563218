"""Why a job failed, in the launcher's one end line: read from the job's output as it is relayed.

A failure at scale is seen by many processes at once, and each knows part of it. The launcher
relays every line the job prints (``relay``) and keeps the facts (``JobOutput.read``):

* rank 0's banner: which host holds which ranks (``placement: node1[0-1] node2[2-3]``);
* horovod's stall inspector, on rank 0: the ranks that never joined a collective (``Missing
  ranks:``, then ``3!: [tensor, ...]`` per rank, the ``!`` on those past the shutdown limit: a
  rank only late, without it, is no cause);
* mpirun: a rank that ended on a signal (``mpirun noticed that process rank 3 with PID 26385 on
  node node2 exited on signal 9 (Killed).``), a node whose daemon it lost (``Remote daemon:
  [[8800,0],1] on node node2``, or ssh's ``Connection to node2 closed by remote host.``);
  horovodrun's Gloo: ``Process 3 exit with status code 255.``; srun: ``srun: error: node2: task
  3: Killed`` (the first such line: srun ends the others after it);
* mpirun's first rank to exit non-zero (``Process name: [[27113,1],0]``, ``Exit code: 2``);
* hvdtrain's reports that every rank reaches together (``errors.report_once``: horovod shut the
  job down, no training step finished), which rank 0 alone prints: the end line says what they
  say, so they are kept from the console (rank 0's log has them).

``JobOutput.verdict`` turns them into "rank 3 on node2 ended on SIGKILL ...; its log: ...".
The formats above are the ones OpenMPI 4.1, horovod 0.28.1, OpenSSH and Slurm 22.05's srun printed
on the local cluster (tests/test_failures.py keeps excerpts); a line in another format is relayed
and simply not read.

What the launch command itself prints once a rank has failed (``END_BANNERS``: OpenMPI's pages
"Primary job terminated normally, but 1 process returned ...", "mpirun detected that one or more
processes exited with non-zero status ...", "mpirun noticed that process rank 1 ... exited on
signal 11"; horovodrun's Gloo lines "Process 1 exit with status code 3." and its traceback) is
kept from the console too (``EndBanners``): the launcher's end line says which rank failed and
how, and is the failed job's last line. Only whole blocks of exactly these lines are kept back; a
rank's own line, or another MPI message, is relayed.
"""
from __future__ import annotations

import re
import signal
import threading
from dataclasses import dataclass, field
from typing import IO

from hvdtrain.errors import NO_STEP_REPORT, SHUT_DOWN_REPORT, signal_name
from hvdtrain.launch.console import lost_stream
from hvdtrain.runtime.base import host_of_each_rank, rank_ranges, ranks_in

#: The prefix horovodrun/mpirun put on a rank's line: ``[1,3]<stderr>:``; horovodrun's Gloo
#: ``[3]<stderr>:``. Group 1 is the rank.
_TAG = re.compile(r"^\[(?:\d+,)?(\d+)\]<std(?:out|err)>:")
_PLACEMENT = re.compile(r"^placement: (.+)$")
_MISSING_RANKS = re.compile(r"Missing ranks:$")
_MISSING_RANK = re.compile(r"^(\d+)(!?): \[")
_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_LOST_DAEMON = re.compile(r"Remote daemon: \[\[\d+,\d+\],\d+\] on node (\S+)")
_SSH_CLOSED = re.compile(r"^Connection to (\S+) closed by remote host")
_GLOO_EXIT = re.compile(r"Process (\d+) exit with status code (\d+)\.")
_SRUN_TASK = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (.+)$")
#: OpenMPI's name of a process is [[job family,job],rank].
_MPIRUN_FIRST_NAME = re.compile(r"  Process name: \[\[\d+,\d+\],(\d+)\]")
_MPIRUN_FIRST_CODE = re.compile(r"  Exit code: +(\d+)")


@dataclass
class JobOutput:
    """What the job's output said about its ranks and its failure, line by line."""

    host_of_rank: dict[int, str] = field(default_factory=dict)
    stalled: set[int] = field(default_factory=set)
    signalled: dict[int, tuple[str, int]] = field(default_factory=dict)
    """rank -> (host, signal number), as mpirun saw them end."""
    lost_hosts: list[str] = field(default_factory=list)
    first_to_fail: tuple[list[int], str | None, str] | None = None
    """(ranks, host, how) of the first rank(s) horovodrun's Gloo or srun saw fail."""
    no_step: tuple[str, str, str] | None = None
    """(rank, host, seconds) of rank 0's stall-watchdog report."""
    shut_down: bool = False
    first_exit: tuple[int, int] | None = None
    """(rank, exit status) of the first rank mpirun saw exit non-zero: the least telling fact
    (after a report every rank reached, rank 0 is the first to exit), read last."""
    _first_exit_rank: int | None = None
    _listing_missing_ranks: set[str] = field(default_factory=set)
    """The tags (``[1,0]<stderr>:``) whose next lines continue a ``Missing ranks:`` list: the
    job's two streams are read on two threads, and other ranks' lines may come in between."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, line: str) -> bool:
        """Take what ``line`` says; False for a report the end line will say instead (keep it
        from the console), True for every other line (relay it)."""
        tag = _TAG.match(line)
        text = line[tag.end():] if tag else line
        with self._lock:
            return self._read(tag.group(0) if tag else "", text.rstrip("\r\n"))

    def _read(self, tag: str, text: str) -> bool:
        if tag in self._listing_missing_ranks:
            missing = _MISSING_RANK.match(text)
            if missing:
                if missing.group(2):
                    self.stalled.add(int(missing.group(1)))
                return True
            self._listing_missing_ranks.discard(tag)
        if _MISSING_RANKS.search(text):
            self._listing_missing_ranks.add(tag)
        elif placement := _PLACEMENT.match(text):
            self.host_of_rank = host_of_each_rank(placement.group(1))
        elif signalled := _SIGNALLED.search(text):
            self.signalled[int(signalled.group(1))] = (signalled.group(2),
                                                       int(signalled.group(3)))
        elif lost := (_LOST_DAEMON.search(text) or _SSH_CLOSED.match(text)):
            if lost.group(1) not in self.lost_hosts:
                self.lost_hosts.append(lost.group(1))
        elif (ended := _GLOO_EXIT.fullmatch(text)) and ended.group(2) != "0":
            self.first_to_fail = self.first_to_fail or (
                [int(ended.group(1))], None, f"exit status {ended.group(2)}")
        elif ended := _SRUN_TASK.match(text):
            self.first_to_fail = self.first_to_fail or (ranks_in(ended.group(2)), ended.group(1),
                                                        ended.group(3).lower())
        elif named := _MPIRUN_FIRST_NAME.fullmatch(text):
            self._first_exit_rank = int(named.group(1))
        elif (code := _MPIRUN_FIRST_CODE.fullmatch(text)) and self._first_exit_rank is not None:
            self.first_exit = self.first_exit or (self._first_exit_rank, int(code.group(1)))
        elif no_step := NO_STEP_REPORT.search(text):
            self.no_step = no_step.group(1, 2, 3)
            return False
        elif SHUT_DOWN_REPORT.search(text):
            self.shut_down = True
            return False
        return True

    def _where(self, ranks: list[int], host: str | None = None) -> str:
        """'rank 3 on node2', 'ranks 2-3 on node2', 'ranks 1,3 on node1, node2' (the hosts from
        rank 0's placement line, unless ``host`` is known)."""
        hosts = [host] if host else sorted({self.host_of_rank[rank] for rank in ranks
                                            if rank in self.host_of_rank})
        return _ranks(ranks) + (f" on {', '.join(hosts)}" if hosts else "")

    def verdict(self, logs_dir: str | None) -> str | None:
        """The failure in words with the log(s) to read, or None when the output said nothing
        the launcher understands (it then names every rank's log)."""
        logs = logs_dir.rstrip("/") if logs_dir else None
        if self.lost_hosts:
            hosts = self.lost_hosts
            ranks = sorted(rank for rank, host in self.host_of_rank.items() if host in hosts)
            said = (f"{', '.join(hosts)} stopped answering (crashed, or its network is down)"
                    + (f" with {_ranks(ranks)} on it" if ranks else ""))
            return said + _logs(logs, ranks)
        if self.stalled:
            ranks = sorted(self.stalled)
            return (f"{self._where(ranks)} stalled: the other ranks waited for "
                    f"{'it' if len(ranks) == 1 else 'them'} in a collective past horovod's stall "
                    "limit (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)" + _logs(logs, ranks))
        if self.signalled:
            first = next(iter(self.signalled))  # the one mpirun noticed first
            host, signum = self.signalled[first]
            said = f"{self._where([first], host)} ended on {signal_name(signum)}"
            if signum == signal.SIGKILL:
                said += " (killed: the out-of-memory killer, or by hand)"
            return said + _logs(logs, [first])
        if self.first_to_fail:
            ranks, host, how = self.first_to_fail
            return f"{self._where(ranks, host)} failed first ({how})" + _logs(logs, ranks)
        if self.no_step:
            rank, host, seconds = self.no_step
            return (f"no training step finished in {seconds} s on rank {rank} on {host}: a peer "
                    "stopped answering (a node or its network link down?)"
                    + _logs(logs, [int(rank)]))
        if self.shut_down:
            return ("horovod shut the job down: a rank failed or stalled in a collective"
                    + _logs(logs, [0]))
        if self.first_exit:
            rank, status = self.first_exit
            return (f"{self._where([rank])} failed first (exit status {status})"
                    + _logs(logs, [rank]))
        return None


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"


def _logs(logs_dir: str | None, ranks: list[int]) -> str:
    if not logs_dir or not ranks:
        return ""
    if len(ranks) == 1:
        return f"; its log: {logs_dir}/rank-{ranks[0]}.log"
    return f"; their logs: {logs_dir}/rank-<K>.log for K in {rank_ranges(ranks)}"


@dataclass(frozen=True)
class _Repeated:
    """Any number of lines matching ``pattern`` (a traceback's frames), within a banner."""

    pattern: re.Pattern


def _banner(*lines) -> tuple:
    """A banner's lines: each a regular expression for one whole line, or ``_Repeated``."""
    return tuple(line if isinstance(line, _Repeated) else re.compile(line) for line in lines)


_DASHES = "-{74}"  # the rule above and below each of OpenMPI's help pages

#: The blocks a launch command prints after a rank failed, whose facts the end line gives
#: (JobOutput reads them). OpenMPI 4.1's help pages help-errmgr-base.txt
#: [normal-termination-but], help-orterun.txt [orterun:non-zero-exit] and
#: [orterun:proc-aborted(-strsignal)]; horovod 0.28.1's runner/gloo_run.py.
END_BANNERS = (
    _banner(_DASHES, r"Primary job  terminated normally, but \d+ process(es)? returned",
            r"(a non-zero exit code|non-zero exit codes)\. Per user-direction, the job has "
            r"been aborted\.", _DASHES),
    _banner(_DASHES, r"\S+ detected that one or more processes exited with non-zero status, "
            r"thus causing", r"the job to be terminated\. The first process to do so was:", "",
            _MPIRUN_FIRST_NAME, _MPIRUN_FIRST_CODE, _DASHES),
    _banner(_DASHES, r"\S+ noticed that process rank \d+ with PID \d+ on node \S+ exited on "
            r"signal \d+( \(.*\))?\.", _DASHES),
    _banner(_GLOO_EXIT),
    _banner(r"Terminating remaining workers after failure of Process \d+\."),
    # horovodrun --gloo raises when a rank failed; its message ends with a newline of its own.
    _banner(r"Traceback \(most recent call last\):", _Repeated(re.compile(r"  .*")),
            r"RuntimeError: Horovod detected that one or more processes exited with non-zero "
            r"status, thus causing the job to be terminated\. The first process to do so was:",
            r"Process name: \d+", r"Exit code: \d+", ""),
)


def _step(banner: tuple, at: int, text: str) -> int | None:
    """Where ``banner`` stands after ``text``, from ``at`` (None: ``text`` does not fit)."""
    element = banner[at]
    if isinstance(element, _Repeated):
        if element.pattern.fullmatch(text):
            return at
        at += 1
        element = banner[at]
    return at + 1 if element.fullmatch(text) else None


class EndBanners:
    """One stream of the job's output with the ``END_BANNERS`` taken out: the lines that may
    begin one are held until the block is complete (dropped) or a line does not fit (all
    passed on, in order). mpirun writes each page at once; a rank's own line that could begin
    one (a rule of 74 dashes, under --via mpirun, which tags no line) waits for its next line."""

    def __init__(self):
        self._held: list[bytes] = []
        self._candidates: list[tuple[tuple, int]] = []
        """(banner, lines of it matched) for each banner the held lines may begin."""

    def pass_on(self, line: bytes) -> list[bytes]:
        """The lines to show now that ``line`` came."""
        text = line.decode(errors="replace").rstrip("\r\n")
        candidates = self._candidates if self._held else [(banner, 0) for banner in END_BANNERS]
        fitting = [(banner, at) for banner, start in candidates
                   if (at := _step(banner, start, text)) is not None]
        if not fitting:
            released = self.rest()
            # The line that broke a block may begin one ("----" after a lone "----").
            return [*released, *self.pass_on(line)] if released else [line]
        if any(at == len(banner) for banner, at in fitting):
            self._held, self._candidates = [], []
        else:
            self._held.append(line)
            self._candidates = fitting
        return []

    def rest(self) -> list[bytes]:
        """The held lines, passed on: the block they began was cut short."""
        held, self._held, self._candidates = self._held, [], []
        return held


def relay(source: IO[bytes], destination: IO[bytes], output: JobOutput,
          name: str = "stdout", logs_dir: str | None = None) -> threading.Thread:
    """Copy the job's lines from ``source`` to ``destination`` (the launcher's ``name``) as they
    come, reading each into ``output`` and leaving out the ``END_BANNERS``; on a thread of its
    own, which ends when every writer of the pipe is gone."""
    def copy() -> None:
        shown = True
        banners = EndBanners()

        def show(lines: list[bytes]) -> None:
            nonlocal shown
            for line in lines:
                if not shown:
                    return
                try:
                    destination.write(line)
                    destination.flush()
                except (OSError, ValueError) as failure:  # a full disk, the console gone
                    # The pipe is still drained to its end: a job blocked on a full pipe would
                    # hang, and a job that succeeded must not be failed for the launcher's disk.
                    shown = False
                    lost_stream(name, failure, logs_dir)

        for line in iter(source.readline, b""):
            if output.read(line.decode(errors="replace")):
                show(banners.pass_on(line))
        show(banners.rest())
        source.close()

    thread = threading.Thread(target=copy, name="hvdtrain-relay", daemon=True)
    thread.start()
    return thread
