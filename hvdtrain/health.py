"""``python -m hvdtrain.health``: is every node fit for the job? One line per finding.

Started on every rank by ``hvdtrain.launch --health-check`` (before the job) or
``--health-check-only``, through the job's own launch path: it tries what the job will use (the
hosts, the ranks' Python and TensorFlow, MPI over the interfaces the network check chose).

* **devices**: every node shows the GPUs its ranks need (``--gpus-per-rank`` x its ranks; 0 on
  CPU nodes), and no node's ranks have far fewer cores each than the others';
* **links**: the first rank of every node sends ``--link-megabytes`` to the next node's first
  rank and to the previous one's (a ring, both ways, one link at a time, best of two); a link
  below ``--slow-fraction`` of the median is named, or the node when all of its outgoing (or
  incoming) links are (``node2: 94 Mbit/s out against 9.1 Gbit/s median``);
* **numbers**: every rank multiplies the same seeded matrices with TensorFlow on its device; a
  rank whose result is not the others' is named (a faulty GPU, a broken math library);
* **allreduce**: every rank averages ``--allreduce-megabytes`` through the job's own runtime
  (horovod: NCCL for GPU tensors where horovod was built with it, else its MPI controller), one
  warm-up then the best of two, checks the sums and reports the bus bandwidth (nccl-tests'
  "busbw": the rate every link of a ring carries). An NCCL allreduce far below the links' median
  (NCCL on another interface or transport than MPI), or one that fails, comes with hints on
  NCCL's own switches (``NCCL_DEBUG``, ``NCCL_SOCKET_IFNAME``, ...). Then a group of tensors
  of several sizes and dtypes, averaged together through horovod's fusion buffer (on GPU ranks
  its copy and scale kernels, which horovod 0.28.1 runs unchecked), every value checked.

Exit 2 when a device is missing, a rank computes other numbers or the allreduce returns wrong
sums; slow links, a slow NCCL allreduce and uneven cores are warnings (exit 0). Rank 0 prints
everything. The links are timed over MPI through mpi4py (what horovod's MPI controller runs on),
the allreduce through hvdtrain's runtime (the one module that imports horovod). Never run on a
GPU here: the GPU count, the numbers' device, the NCCL allreduce and its hints are written for
GPU nodes and unit-tested on their logic only.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from hvdtrain.cli import error_name, usage_name
from hvdtrain.errors import as_one_line, reported
from hvdtrain.flags import OneLineParser, ProseHelpFormatter
from hvdtrain.gpus import gpu_of_its_own

PROGRAM = "hvdtrain.health"
EXIT_FAILED = 2
#: Test-only: this rank's result is nudged by one part in a thousand, so that the tests can show
#: that a rank computing other numbers is named. Nothing else reads it.
PERTURB_VARIABLE = "HVDTRAIN_HEALTH_TEST_PERTURB_RANK"
#: Test-only: this rank sends zeros for the last float32 tensor of the fused check, as a copy
#: into the fusion buffer that never ran would leave it. Nothing else reads it.
STALE_VARIABLE = "HVDTRAIN_HEALTH_TEST_STALE_RANK"


@dataclass(frozen=True)
class RankReport:
    rank: int
    host: str
    local_size: int
    gpus: int
    cores: int
    result: float
    allreduce_problem: str = ""
    """What was wrong with this rank's allreduce ("" when it returned the due average)."""
    gpu_of_its_own: bool = False
    """The scheduler gave this rank one GPU of its own (srun --gpus-per-task): it needs no more
    (``runtime.base.choose_gpu``, the rule the ranks follow)."""


@dataclass(frozen=True)
class AllreduceTiming:
    """Rank 0's best time for one allreduce of ``nbytes`` over ``ranks`` ranks."""
    nbytes: int
    seconds: float
    ranks: int
    transport: str
    """"NCCL", or the horovod controller ("MPI") that carried it."""

    def bus_bits_per_second(self) -> float:
        """nccl-tests' bus bandwidth: a ring allreduce moves 2 (n - 1) / n of the buffer through
        every link, so this is comparable with a link's rate whatever the rank count."""
        if self.ranks < 2 or self.seconds <= 0:
            return 0.0
        return self.nbytes * 8 * 2 * (self.ranks - 1) / self.ranks / self.seconds


# --- the verdicts (pure: unit-tested without MPI or TensorFlow) -----------------------------------
def rate_text(bits_per_second: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second / 1e3:.3g} kbit/s"


def slow_links(rates: dict[tuple[str, str], float], slow_fraction: float) -> list[str]:
    """Warnings for links (source host, destination host) -> bit/s below ``slow_fraction`` of
    the median: a node whose every outgoing or every incoming link is slow is named once, any
    other slow link on its own."""
    if not rates:
        return []
    median = statistics.median(rates.values())
    slow = {link for link, rate in rates.items() if rate < slow_fraction * median}
    findings, explained = [], set()
    hosts = sorted({host for link in rates for host in link})
    # Outgoing first (a shaped or failing sender is the usual cause); a node's incoming links
    # are named only when a sender does not already explain them (with two nodes, node2's
    # slow link out is node1's only link in).
    for direction, index in (("out", 0), ("in", 1)):
        for host in hosts:
            links = [link for link in rates if link[index] == host]
            if links and all(link in slow for link in links) and not explained >= set(links):
                worst = min(rates[link] for link in links)
                findings.append(f"{host}: {rate_text(worst)} {direction} against "
                                f"{rate_text(median)} median")
                explained.update(links)
    for link in sorted(slow - explained):
        findings.append(f"link {link[0]} -> {link[1]}: {rate_text(rates[link])} against "
                        f"{rate_text(median)} median")
    return findings


def disagreeing(reports: Sequence[RankReport], tolerance: float = 1e-5) -> list[str]:
    """Failures for ranks whose result is not the majority's (equal within a relative
    ``tolerance``); one line for all of them when no result has a majority."""
    groups: list[list[RankReport]] = []
    for report in sorted(reports, key=lambda report: report.result):
        last = groups[-1][-1].result if groups else None
        if last is not None and abs(report.result - last) <= tolerance * max(abs(last), 1e-30):
            groups[-1].append(report)
        else:
            groups.append([report])
    if len(groups) == 1:
        return []
    groups.sort(key=len, reverse=True)
    if len(groups[0]) == len(groups[1]):
        said = ", ".join(f"rank {r.rank} on {r.host} {r.result:.9g}" for r in reports)
        return [f"the ranks computed different numbers and no result has a majority ({said}): "
                "a faulty device or math library"]
    reference = groups[0][0].result
    return [f"rank {report.rank} on {report.host} computed {report.result:.9g} where "
            f"{len(groups[0])} other rank(s) computed {reference:.9g}: a faulty device or math "
            "library" for group in groups[1:] for report in group]


def device_findings(reports: Sequence[RankReport], gpus_per_rank: int
                    ) -> tuple[list[str], list[str]]:
    """(failures, warnings): nodes short of GPUs; nodes whose ranks have under half the median
    cores each."""
    failures, warnings = [], []
    short: dict[str, tuple[RankReport, int]] = {}
    for report in reports:
        # A rank with a GPU of its own needs that one; ranks that share a node's GPUs need one
        # each of those they all see.
        needed = gpus_per_rank * (1 if report.gpu_of_its_own else report.local_size)
        if report.gpus < needed:
            short.setdefault(report.host, (report, needed))
    for host, (report, needed) in short.items():
        whose = "its rank" if report.gpu_of_its_own else f"its {report.local_size} rank(s)"
        failures.append(f"{host} shows {report.gpus} GPU(s); {whose} need {needed} (a GPU "
                        "lost, or CUDA_VISIBLE_DEVICES?)")
    by_host: dict[str, RankReport] = {}
    for report in reports:
        by_host.setdefault(report.host, report)
    median_cores = statistics.median(report.cores for report in reports)
    for host, report in by_host.items():
        if report.cores < median_cores / 2:
            warnings.append(f"{host}: {report.cores} core(s) per rank against "
                            f"{median_cores:g} median (a smaller CPU share)")
    return failures, warnings


def allreduce_findings(reports: Sequence[RankReport], timing: AllreduceTiming,
                       link_median: float | None, slow_link_named: bool, slow_fraction: float
                       ) -> tuple[list[str], list[str]]:
    """(failures, warnings) of the allreduce: ranks whose sums were wrong (or whose allreduce
    failed); an NCCL allreduce below ``slow_fraction`` of the MPI links' median, unless a slow
    link already explains it. MPI's own allreduce is not judged against its links (its
    algorithm and copies differ from a ring's, and the links were timed over MPI anyway)."""
    by_problem: dict[str, list[RankReport]] = {}
    for report in reports:
        if report.allreduce_problem:
            by_problem.setdefault(report.allreduce_problem, []).append(report)
    failures = []
    for problem, alike in by_problem.items():
        # A collective that goes wrong usually goes wrong on every rank alike: one line, not N.
        who = ("every rank" if len(alike) == len(reports) > 1 else
               ", ".join(f"rank {report.rank} on {report.host}" for report in alike))
        failures.append(f"{who}: the {timing.transport} allreduce {problem}")
    warnings = []
    bus = timing.bus_bits_per_second()
    if (not failures and timing.transport == "NCCL" and link_median and not slow_link_named
            and bus < slow_fraction * link_median):
        warnings.append(f"the NCCL allreduce carried {rate_text(bus)} per link against the MPI "
                        f"links' {rate_text(link_median)} median: NCCL on another interface or "
                        "transport than MPI?")
    return failures, warnings


def nccl_hints(environ: Mapping[str, str], nodes: int) -> list[str]:
    """What to look at when an NCCL allreduce failed or was slow: NCCL's own switches, as this
    rank's environment sets them (the job's, since the check runs through its launch)."""
    hints = ["NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET in the job's environment makes every "
             "rank print the transport (IB, Socket) and the interface NCCL chose"]
    if nodes > 1 and not environ.get("NCCL_SOCKET_IFNAME"):
        hints.append("NCCL_SOCKET_IFNAME is not set, so NCCL picks a socket interface itself "
                     "(docker0, a management network?): --network-interface IFACE sets it")
    for name, what in (("NCCL_IB_DISABLE", "InfiniBand (NCCL runs over sockets)"),
                       ("NCCL_P2P_DISABLE", "GPU peer-to-peer (NVLink, PCIe) within a node"),
                       ("NCCL_SHM_DISABLE", "shared memory within a node")):
        if environ.get(name) == "1":
            hints.append(f"{name}=1 turns off {what}")
    return hints


# --- the ranks' side --------------------------------------------------------------------------------
def compute(rank: int) -> float:
    """The same product on every rank, on its own device: the sum of |A @ B| for seeded A, B."""
    import numpy as np
    import tensorflow as tf

    generator = np.random.default_rng(20261125)
    a, b = (generator.standard_normal((512, 512)).astype("float32") for _ in range(2))
    result = float(tf.reduce_sum(tf.abs(tf.linalg.matmul(a, b))).numpy())
    if os.environ.get(PERTURB_VARIABLE) == str(rank):
        result *= 1.001
    return result


def visible_gpus() -> int:
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def measure_links(comm, megabytes: float) -> dict[tuple[str, str], float]:
    """On the first rank of every node: {(source, destination): bit/s} round a ring of nodes,
    both ways; {} elsewhere. One link at a time, so that no two transfers share a wire."""
    import numpy as np
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    leaders = comm.Split(0 if local.Get_rank() == 0 else MPI.UNDEFINED, comm.Get_rank())
    local.Free()
    if leaders == MPI.COMM_NULL:
        return {}
    hosts = leaders.allgather(socket.gethostname())
    count, me = leaders.Get_size(), leaders.Get_rank()
    links = sorted({(i, (i + step) % count) for i in range(count) for step in (1, -1)
                    if count > 1 and (i + step) % count != i})
    payload = np.ones(int(megabytes * 2**20), dtype=np.uint8)
    ack = np.zeros(1, dtype=np.uint8)
    rates = {}
    for source, destination in links:
        leaders.Barrier()
        best = 0.0
        for _ in range(2):
            if me == source:
                started = time.perf_counter()
                leaders.Send(payload, dest=destination)
                leaders.Recv(ack, source=destination)
                best = max(best, payload.nbytes * 8 / (time.perf_counter() - started))
            elif me == destination:
                leaders.Recv(payload, source=source)
                leaders.Send(ack, dest=source)
        if me == source:
            rates[(hosts[source], hosts[destination])] = best
    leaders.Free()
    return rates


def time_allreduce(runtime, count: int, repeats: int = 2) -> tuple[float, str]:
    """(best seconds of ``repeats`` allreduces after a warm-up, what was wrong with the
    result or "") for ``count`` float32 on this rank's device: every rank sends rank + 1, so
    the average is (size + 1) / 2 everywhere."""
    import tensorflow as tf

    size = runtime.world.size
    tensor = tf.fill([count], float(runtime.world.rank + 1))
    due = (size + 1) / 2
    best = float("inf")
    try:
        for attempt in range(repeats + 1):
            started = time.perf_counter()
            averaged = runtime.allreduce(tensor, name="hvdtrain_health_allreduce")
            float(averaged[0])  # waits for the whole result, copies one number to the host
            if attempt:
                best = min(best, time.perf_counter() - started)
        worst = float(tf.reduce_max(tf.abs(averaged - due)))
    except Exception as error:  # an NCCL or MPI error: the finding, not a traceback
        return best, f"failed: {as_one_line(error)}"
    if worst > 1e-5 * due:
        return best, f"returned values up to {worst:.3g} off the due average {due:g}"
    return best, ""


#: The groups the fused check averages, one per dtype (horovod groups and fuses tensors of one
#: dtype): several sizes each, float32 as gradients and float16 as --fp16-allreduce sends them.
#: They pass through horovod's fusion buffer together, with its copy and scale kernels on GPU
#: ranks; a copy that did not run leaves other memory in the buffer, which a single tensor
#: (NCCL's own average) would not show.
FUSED_GROUPS = {"float32": (1, 1000, 65539), "float16": (7, 4097)}


def check_fused_allreduce(runtime) -> str:
    """What was wrong with the grouped averages of ``FUSED_GROUPS`` ("" when every value is
    due). Rank r sends (r + 1) times a pattern that differs from element to element, so a value
    copied to the wrong place is caught as well as a stale one."""
    import numpy as np
    import tensorflow as tf

    size, rank = runtime.world.size, runtime.world.rank
    wrong = []
    for dtype, counts in FUSED_GROUPS.items():
        patterns = [(np.arange(count) % 7 + 1).astype(dtype) for count in counts]
        sent = [pattern * (rank + 1) for pattern in patterns]
        if os.environ.get(STALE_VARIABLE) == str(rank) and dtype == "float32":
            sent[-1] = np.zeros_like(sent[-1])
        try:
            averaged = runtime.grouped_allreduce([tf.constant(values) for values in sent],
                                                 name=f"hvdtrain_health_fused_{dtype}")
            results = [result.numpy() for result in averaged]
        except Exception as error:  # an NCCL or MPI error: the finding, not a traceback
            return f"of a group of {dtype} tensors failed: {as_one_line(error)}"
        for count, pattern, result in zip(counts, patterns, results):
            due = pattern.astype("float64") * (size + 1) / 2
            off = float(np.max(np.abs(result.astype("float64") - due)))
            if off > (1e-2 if dtype == "float16" else 1e-5) * float(np.max(due)):
                wrong.append(f"{dtype}[{count}] up to {off:.3g} off")
    if wrong:
        return ("of grouped tensors (through the fusion buffer) returned values off the due "
                f"average: {', '.join(wrong)}")
    return ""


def main(argv: Sequence[str] | None = None) -> None:
    parser = OneLineParser(prog=usage_name(PROGRAM), description=__doc__,
                           formatter_class=ProseHelpFormatter)
    parser.add_argument("--gpus-per-rank", type=int, default=0,
                        help="GPUs every rank needs (0: CPU nodes)")
    parser.add_argument("--link-megabytes", type=float, default=32.0,
                        help="MiB sent over each link, twice (default: 32)")
    parser.add_argument("--allreduce-megabytes", type=float, default=16.0,
                        help="MiB of float32 every rank allreduces, three times (default: 16)")
    parser.add_argument("--slow-fraction", type=float, default=0.25,
                        help="a link below this fraction of the median is slow (default: 0.25)")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with reported(error_name(PROGRAM)):
        failed = check(parser.parse_args(argv))
    if failed:
        sys.exit(EXIT_FAILED)


def check(args: argparse.Namespace) -> bool:
    """Every rank: measure, gather on rank 0, which prints the verdict; every rank returns it."""
    from hvdtrain.runtime import make_runtime

    started = time.monotonic()
    # The job's own runtime, started first: horovod's controller owns MPI (mpi4py joins it, as
    # in the runtime itself), and the rank is pinned to its GPU (or sized to its CPU share)
    # before TensorFlow starts, so the product and the allreduce run where the job's would.
    runtime = make_runtime("horovod")
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = runtime.world.rank
    result = compute(rank)
    count = int(args.allreduce_megabytes * 2**20) // 4
    seconds, problem = time_allreduce(runtime, count)
    problem = problem or check_fused_allreduce(runtime)
    report = RankReport(rank, socket.gethostname(), runtime.world.local_size, visible_gpus(),
                        len(os.sched_getaffinity(0)), result, problem,
                        gpu_of_its_own(os.environ.get("CUDA_VISIBLE_DEVICES")))
    timing = AllreduceTiming(count * 4, seconds, runtime.world.size,
                             runtime.allreduce_transport())
    rates = measure_links(comm, args.link_megabytes)
    reports = comm.gather(report, root=0)
    all_rates = comm.gather(rates, root=0)
    failed = False
    if rank == 0:
        failed = verdict(reports, {link: rate for part in all_rates for link, rate in part.items()},
                         timing, args.gpus_per_rank, args.slow_fraction,
                         time.monotonic() - started)
    # Every rank leaves with the verdict: mpirun and srun report the first non-zero status.
    return comm.bcast(failed, root=0)


def verdict(reports: Sequence[RankReport], links: dict[tuple[str, str], float],
            timing: AllreduceTiming, gpus_per_rank: int, slow_fraction: float,
            seconds: float) -> bool:
    """Rank 0: print the findings, one line each, and the summary; True when a check failed."""
    failures, warnings = device_findings(reports, gpus_per_rank)
    failures += disagreeing(reports)
    slow = slow_links(links, slow_fraction)
    link_median = statistics.median(links.values()) if links else None
    allreduce_failures, allreduce_warnings = allreduce_findings(
        reports, timing, link_median, bool(slow), slow_fraction)
    failures += allreduce_failures
    warnings += slow + allreduce_warnings
    hosts = len({report.host for report in reports})
    hints = (nccl_hints(os.environ, hosts)
             if timing.transport == "NCCL" and (allreduce_failures or allreduce_warnings) else [])
    for kind, lines in (("failed", failures), ("warning", warnings), ("hint", hints)):
        for line in lines:
            print(f"{PROGRAM}: {kind}: {line}", flush=True)
    median = f"links {rate_text(link_median)} median" if links else "one node, no links"
    bus = rate_text(timing.bus_bits_per_second())
    allreduce = (f"allreduce {timing.nbytes / 2**20:g} MiB {bus} bus ({timing.transport})"
                 if timing.ranks > 1 and not allreduce_failures
                 else f"allreduce ({timing.transport})")
    print(f"{PROGRAM}: {'FAILED' if failures else 'ok'}: {len(reports)} rank(s) on {hosts} "
          f"node(s), {median}, {allreduce}, {seconds:.1f} s", flush=True)
    return bool(failures)


if __name__ == "__main__":
    main()
