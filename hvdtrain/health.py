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
  rank whose result is not the others' is named (a faulty GPU, a broken math library).

Exit 2 when a device is missing or a rank computes other numbers; slow links and uneven cores
are warnings (exit 0). Rank 0 prints everything. MPI through mpi4py (what horovod's MPI
controller runs on); no horovod import. Never run on a GPU here: the GPU count and the
numbers' device are written for GPU nodes and unit-tested on their logic only.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Sequence

PROGRAM = "hvdtrain.health"
EXIT_FAILED = 2
#: Test-only: this rank's result is nudged by one part in a thousand, so that the tests can show
#: that a rank computing other numbers is named. Nothing else reads it.
PERTURB_VARIABLE = "HVDTRAIN_HEALTH_TEST_PERTURB_RANK"


@dataclass(frozen=True)
class RankReport:
    rank: int
    host: str
    local_size: int
    gpus: int
    cores: int
    result: float


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
    by_host: dict[str, RankReport] = {}
    for report in reports:
        by_host.setdefault(report.host, report)
    for host, report in by_host.items():
        needed = gpus_per_rank * report.local_size
        if report.gpus < needed:
            failures.append(f"{host} shows {report.gpus} GPU(s); its {report.local_size} rank(s) "
                            f"need {needed} (a GPU lost, or CUDA_VISIBLE_DEVICES?)")
    median_cores = statistics.median(report.cores for report in reports)
    for host, report in by_host.items():
        if report.cores < median_cores / 2:
            warnings.append(f"{host}: {report.cores} core(s) per rank against "
                            f"{median_cores:g} median (a smaller CPU share)")
    return failures, warnings


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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {PROGRAM}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus-per-rank", type=int, default=0,
                        help="GPUs every rank needs (0: CPU nodes)")
    parser.add_argument("--link-megabytes", type=float, default=32.0,
                        help="MiB sent over each link, twice (default: 32)")
    parser.add_argument("--slow-fraction", type=float, default=0.25,
                        help="a link below this fraction of the median is slow (default: 0.25)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    local_size = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    started = time.monotonic()
    report = RankReport(rank, socket.gethostname(), local_size, visible_gpus(),
                        len(os.sched_getaffinity(0)), compute(rank))
    rates = measure_links(comm, args.link_megabytes)
    reports = comm.gather(report, root=0)
    all_rates = comm.gather(rates, root=0)
    failed = False
    if rank == 0:
        failed = verdict(reports, {link: rate for part in all_rates for link, rate in part.items()},
                         args.gpus_per_rank, args.slow_fraction, time.monotonic() - started)
    # Every rank leaves with the verdict: mpirun and srun report the first non-zero status.
    if comm.bcast(failed, root=0):
        sys.exit(EXIT_FAILED)


def verdict(reports: Sequence[RankReport], links: dict[tuple[str, str], float],
            gpus_per_rank: int, slow_fraction: float, seconds: float) -> bool:
    """Rank 0: print the findings, one line each, and the summary; True when a check failed."""
    failures, warnings = device_findings(reports, gpus_per_rank)
    failures += disagreeing(reports)
    warnings += slow_links(links, slow_fraction)
    for line in failures:
        print(f"{PROGRAM}: failed: {line}", flush=True)
    for line in warnings:
        print(f"{PROGRAM}: warning: {line}", flush=True)
    hosts = len({report.host for report in reports})
    median = (f"links {rate_text(statistics.median(links.values()))} median" if links
              else "one node, no links")
    print(f"{PROGRAM}: {'FAILED' if failures else 'ok'}: {len(reports)} rank(s) on {hosts} "
          f"node(s), {median}, {seconds:.1f} s", flush=True)
    return bool(failures)

if __name__ == "__main__":
    main()
