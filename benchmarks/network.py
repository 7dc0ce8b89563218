"""Two hosts and a limited link: measured step times, and a step-time model that explains them.

`python -m benchmarks network` (root: it builds the local cluster of tests/cluster/cluster-local.sh
and limits its links with `tc ... tbf`). One rank on each of node1 and node2 trains the CNN on
synthetic 32x32 images, 64 per rank, one thread each, started by `hvdtrain.launch --hosts
node1:1,node2:1`, each node on a CPU of its own (`up --pin-cpus`). Variants: fp32 gradients,
`--fp16-allreduce`, a fusion buffer of 512 MiB, and fp32 with Open MPI's TCP eager limit raised
to 4 MiB; link rates: no limit, 1 Gbit/s and
100 Mbit/s (a tbf qdisc on both nodes' eth0). Each round runs every variant at every rate, a
variant's three rates back to back. Each run's steady step time is the global batch over its
samples/s (first epoch dropped).

The model (docs/benchmarks.md): a step is the unlimited step with its allreduce window
replaced by the limited one,

    t_step(rate) = t_base - W0 + max(W0, wire_bytes / rate + handshake(rate))

t_base is the same variant's step without a limit; W0 its allreduce window there, from a horovod
timeline of the same run (from the start of the fused group holding the largest gradient to the
end of the step's last allreduce; the rest of the backward pass runs inside it, so a transfer
shorter than W0 hides behind it). wire_bytes is what each node sends per step: a 2-rank
allreduce sends the whole gradient once each way (2 (N-1)/N of it for N ranks), halved by fp16
compression, plus TCP/IP headers. handshake(rate) is Open MPI's rendezvous: in the first exchange
of the ring one direction's data beyond the eager fragment waits behind the other direction's
data, which costs (largest gradient / 2 - eager limit) / rate.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from benchmarks.harness import interleave
from benchmarks.suite import (REPO, BenchmarkFailed, Settings, _env, _training_args,
                              steady_state)

CLUSTER = REPO / "tests" / "cluster" / "cluster-local.sh"
#: Link rates in bit/s (None: no limit).
RATES = {"no limit": None, "1 Gbit/s": 1e9, "100 Mbit/s": 1e8}
#: Open MPI's TCP transport sends a message above its eager limit (64 KiB) only after a
#: handshake with the receiver; both ranks' control messages share each TCP connection with their
#: bulk data, so when the link is the bottleneck a handshake waits behind the data queued ahead
#: of it (docs/benchmarks.md). With the limit above the largest fused allreduce, every message
#: goes out at once and no handshake sits in the transfer.
EAGER_TCP = {"OMPI_MCA_btl_tcp_eager_limit": str(4 << 20),
             "OMPI_MCA_btl_tcp_max_send_size": str(4 << 20)}
#: Variant -> (launcher flags, training flags, environment).
VARIANTS = {"fp32": ((), (), {}), "fp16 allreduce": ((), ("--fp16-allreduce",), {}),
            "fusion 512 MiB": (("--fusion-threshold-mb", "512"), (), {}),
            "fp32, eager TCP 4 MiB": ((), (), EAGER_TCP)}
#: Bytes on the wire per byte of data: a 1500-byte IP packet carries 1448 bytes of TCP data
#: (20 IP + 32 TCP header bytes with timestamps); tbf counts whole packets.
WIRE_OVERHEAD = 1500 / 1448
RESNET50_PARAMETERS = 25_600_000
#: Open MPI's default TCP eager limit (btl_tcp_eager_limit).
EAGER_LIMIT = 64 * 1024
#: The isolated allreduce's size: the dense layer's kernel, the CNN's largest gradient.
ISOLATED_MB = 0.5
#: Calls of the isolated allreduce per variant (its times are bimodal by default: many needed).
ISOLATED_REPEATS = 30


def wire_bytes(gradient_bytes: float, ranks: int, fp16: bool) -> float:
    """Bytes each rank sends per allreduce (ring: 2 (N-1)/N of the buffer), with headers."""
    payload = gradient_bytes * (0.5 if fp16 else 1.0)
    return 2 * (ranks - 1) / ranks * payload * WIRE_OVERHEAD


def handshake_seconds(largest_gradient_bytes: float, fp16: bool, eager_limit: int,
                      rate_bits: float) -> float:
    """What Open MPI's rendezvous adds to a 2-rank allreduce on a link that is the bottleneck.

    The ring's first exchange sends half the fused buffer each way. A message above the eager
    limit goes out as one eager fragment, then waits for the receiver's acknowledgement; when the
    ranks arrive at different times, the later rank's acknowledgement travels behind the earlier
    rank's bulk data in the same TCP connection, so one direction's data beyond the eager fragment
    starts only when the other direction's is through. The group holding the largest gradient
    is charged (the rest of the gradients are small and fused with it or sent after it).
    """
    half_message = largest_gradient_bytes * (0.5 if fp16 else 1.0) / 2
    return max(0.0, half_message - eager_limit) * WIRE_OVERHEAD * 8 / rate_bits


def predicted_window(base_window_seconds: float, gradient_bytes: float,
                     largest_gradient_bytes: float, ranks: int, fp16: bool, eager_limit: int,
                     rate_bits: float | None) -> float:
    """The allreduce window on a limited link: the transfer with its handshake, or the unlimited
    window when that is longer.

    The window without a limit holds the rest of the backward pass (the transfer starts when the
    largest gradient is ready, and the convolutions' gradients are still being computed), so a
    transfer shorter than it hides; a longer one sets the window.
    """
    if rate_bits is None:
        return base_window_seconds
    transfer = (wire_bytes(gradient_bytes, ranks, fp16) * 8 / rate_bits
                + handshake_seconds(largest_gradient_bytes, fp16, eager_limit, rate_bits))
    return max(base_window_seconds, transfer)


def predicted_step(base_seconds: float, base_window_seconds: float, gradient_bytes: float,
                   largest_gradient_bytes: float, ranks: int, fp16: bool, eager_limit: int,
                   rate_bits: float | None) -> float:
    """The model: the unlimited step, its allreduce window replaced by the limited link's."""
    return base_seconds - base_window_seconds + predicted_window(
        base_window_seconds, gradient_bytes, largest_gradient_bytes, ranks, fp16, eager_limit,
        rate_bits)


def allreduce_windows(timeline_path: Path, skip_steps: int) -> list[float]:
    """Seconds of each step's allreduce window, from rank 0's horovod timeline.

    A window runs from the start of the allreduce of the group holding the largest gradient to
    the end of the step's last gradient allreduce. Horovod records one ALLREDUCE span per
    gradient per step (fused gradients share their span); the k-th span of every gradient
    belongs to step k. The first ``skip_steps`` (tracing, warm-up) are dropped.
    """
    text = timeline_path.read_text().rstrip()
    # Horovod closes the JSON array only at a clean shutdown.
    events = json.loads(text if text.endswith("]") else text.rstrip(",") + "]")
    # Named gradient allreduces: ``...HorovodAllreduce_grads_6_0``, or ``..._Cast_1_0`` with
    # fp16 compression; a bare ``HorovodAllreduce`` is the metrics' averaging.
    gradients = {e["pid"] for e in events if e.get("name") == "process_name"
                 and "HorovodAllreduce_" in e.get("args", {}).get("name", "")}
    spans: dict[int, list[tuple[float, float]]] = {pid: [] for pid in gradients}
    elements: dict[int, int] = {}
    open_spans: dict[int, list[tuple[str, float]]] = {pid: [] for pid in gradients}
    for event in events:
        pid = event.get("pid")
        if pid not in gradients:
            continue
        if event.get("ph") == "B":
            open_spans[pid].append((event["name"], event["ts"]))
        elif event.get("ph") == "E" and open_spans[pid]:
            name, start = open_spans[pid].pop()
            if name == "ALLREDUCE":
                spans[pid].append((start, event["ts"]))
                shape = json.loads(event.get("args", {}).get("shape", "[]"))
                elements[pid] = math.prod(shape)
    steps = min(len(s) for s in spans.values())
    largest = max(elements, key=elements.get)
    return [(max(spans[pid][k][1] for pid in gradients) - spans[largest][k][0]) / 1e6
            for k in range(skip_steps, steps)]


def cluster(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True,
                          check=check, timeout=900)


def limit_links(rate_bits: float | None) -> None:
    """A tbf qdisc on both nodes' eth0 (what each node sends), or none."""
    for node in ("node1", "node2"):
        cluster("exec", node, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        if rate_bits is not None:
            # Burst: 1 ms of traffic (at least 64 KiB) keeps the rate smooth at this scale.
            burst = max(64 * 1024, int(rate_bits / 8 / 1000))
            cluster("exec", node, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                    f"{int(rate_bits)}bit", "burst", str(burst), "latency", "200ms")


def gradient_bytes(image_size: int) -> tuple[int, int]:
    """Bytes of the CNN's trainable weights (float32) for this input, as hvdtrain.cnn builds
    it, and of its largest weight."""
    code = ("import hvdtrain, json\n"
            "from hvdtrain.models.cnn import build_cnn\n"
            f"model = build_cnn(({image_size}, {image_size}, 1), 10)\n"
            "sizes = [int(w.shape.num_elements()) for w in model.trainable_weights]\n"
            "print(json.dumps([sum(sizes), max(sizes)]))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=_env(), check=True, timeout=300).stdout
    total, largest = json.loads(output.strip().splitlines()[-1])
    return 4 * total, 4 * largest


def launch_on_two_nodes(s: Settings, environment: dict[str, str], launcher_flags,
                        module_argv: list[str], what: str) -> None:
    """Run ``python -m hvdtrain.launch ... MODULE ARGS`` from node1, one rank on each node."""
    # mpirun hands OMPI_MCA_* variables of its own environment to every rank on every node.
    argv = ["exec", "node1", "env", *(f"{k}={v}" for k, v in environment.items()),
            sys.executable, "-m", "hvdtrain.launch", "--hosts", "node1:1,node2:1",
            "--network-interface", "eth0", "--skip-preflight", *launcher_flags, *module_argv]
    # The node's commands inherit this environment, and horovodrun exports it to both ranks:
    # its PYTHONPATH lets them import ``benchmarks`` (the nodes share this filesystem).
    completed = subprocess.run(["bash", str(CLUSTER), *argv], capture_output=True, text=True,
                               env=_env(), cwd=REPO, timeout=s.timeout)
    if completed.returncode:
        raise BenchmarkFailed(f"a 2-node {what} exited {completed.returncode}:\n"
                              f"{(completed.stdout + completed.stderr)[-3000:]}")


def two_node_run(s: Settings, workdir: Path, launcher_flags, training_flags,
                 environment: dict[str, str]) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    # Every run writes a timeline (the same small cost in every run): the unlimited runs give
    # the model its window, the limited ones show the window the model predicts.
    timeline = run_dir / "timeline.json"
    launch_on_two_nodes(s, environment, (*launcher_flags, "--timeline-filename", str(timeline)),
                        ["hvdtrain.cnn", *_training_args(s, "synthetic"), "--threads-per-worker",
                         "1", "--no-rank-logs", *training_flags, "--run-dir", str(run_dir)],
                        "run")
    result = steady_state(json.loads((run_dir / "metrics.json").read_text()), 0.0)
    result["step_seconds"] = 2 * s.batch_size / result["samples_per_sec"]
    result["window_seconds"] = statistics.median(allreduce_windows(timeline, s.steps_per_epoch))
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def isolated_allreduce(s: Settings, workdir: Path, environment: dict[str, str],
                       size_mb: float = ISOLATED_MB) -> list[float]:
    """Seconds of each horovod allreduce of ``size_mb`` between the nodes, nothing else running."""
    out = Path(tempfile.mkdtemp(dir=workdir)) / "allreduce.json"
    launch_on_two_nodes(s, environment, (),
                        ["benchmarks.allreduce", "--sizes-mb", f"{size_mb:g}", "--repeats",
                         str(ISOLATED_REPEATS), "--json", str(out)], "allreduce")
    return json.loads(out.read_text())["sizes"][f"{size_mb:g}"]["horovod"]["seconds"]


def measure(s: Settings, workdir: Path, log: Callable[[str], None]) -> dict:
    """Every variant x rate, interleaved; the model's predictions beside them.

    This machine drifts by tens of percent over minutes, so a prediction is only compared with
    a run made next to its own calibration: each round runs one variant at every rate in a row
    (no limit, 1 Gbit/s, 100 Mbit/s, the order reversed every other round), and a round's
    prediction for a limited link starts from the same round's unlimited step.
    """
    grad_bytes, largest_bytes = gradient_bytes(s.image_size)
    log(f"network: CNN gradient {grad_bytes / 2**20:.2f} MiB, 1 rank on each of 2 nodes")

    def limited_run(rate, flags):
        limit_links(rate)
        return two_node_run(s, workdir, *flags)

    pairs = interleave({f"{name} @ {rate_name}": (lambda rate=rate, flags=flags:
                                                  limited_run(rate, flags))
                        for name, flags in VARIANTS.items() for rate_name, rate in RATES.items()},
                       repeats=s.repeats, warmup=s.warmup, log=log)
    # The handshake's cost, alone: the dense layer's 0.5 MiB kernel, without and with it.
    limit_links(RATES["100 Mbit/s"])
    isolated = {variant: sorted(isolated_allreduce(s, workdir, environment))
                for variant, environment in (("fp32", {}), ("fp32, eager TCP 4 MiB", EAGER_TCP))}
    limit_links(None)
    runs = {rate_name: {name: pairs[f"{name} @ {rate_name}"] for name in VARIANTS}
            for rate_name in RATES}
    rows = []
    for rate_name, rate in RATES.items():
        for name in VARIANTS:
            steps = [m["step_seconds"] for m in runs[rate_name][name]]
            bases = runs["no limit"][name]
            eager = int(VARIANTS[name][2].get("OMPI_MCA_btl_tcp_eager_limit", EAGER_LIMIT))
            # The base is the same variant without a limit (fp16 compression costs a cast), and
            # from the same round: the prediction is paired with the run it predicts.
            link = (grad_bytes, largest_bytes, 2, name == "fp16 allreduce", eager, rate)
            predicted = [predicted_step(base["step_seconds"], base["window_seconds"], *link)
                         for base in bases]
            predicted_windows = [predicted_window(base["window_seconds"], *link) for base in bases]
            windows = [m["window_seconds"] for m in runs[rate_name][name]]
            rows.append({"rate": rate_name, "variant": name,
                         "measured_ms": statistics.median(steps) * 1e3,
                         "predicted_ms": statistics.median(predicted) * 1e3,
                         "error": statistics.median(p / m - 1 for p, m in zip(predicted, steps)),
                         "window_ms": statistics.median(windows) * 1e3,
                         "predicted_window_ms": statistics.median(predicted_windows) * 1e3,
                         "samples_per_sec": 2 * s.batch_size / statistics.median(steps)})
    return {"gradient_bytes": grad_bytes, "largest_gradient_bytes": largest_bytes, "rows": rows,
            "runs": runs, "isolated_allreduce_0.5MiB_100Mbit_seconds": isolated,
            "isolated_handshake_model_ms": handshake_seconds(
                ISOLATED_MB * 2**20, False, EAGER_LIMIT, RATES["100 Mbit/s"]) * 1e3,
            "projections": projections(grad_bytes)}


def projections(cnn_gradient_bytes: int) -> list[dict]:
    """What the model says for 8 GPUs per node: the allreduce's time per step on 25 and
    100 Gbit/s for this CNN and for ResNet-50's gradients, on 2 and 8 nodes (a flat ring over
    all GPUs: every node's link carries 2 (N-1)/N of the buffer each way)."""
    rows = []
    for model, grad_bytes in (("this CNN", cnn_gradient_bytes),
                              ("ResNet-50 (25.6 M parameters)", 4 * RESNET50_PARAMETERS)):
        for nodes in (2, 8):
            for gbit in (25, 100):
                for fp16 in (False, True):
                    seconds = wire_bytes(grad_bytes, 8 * nodes, fp16) * 8 / (gbit * 1e9)
                    rows.append({"model": model, "nodes": nodes, "gpus": 8 * nodes,
                                 "link_gbit": gbit, "fp16": fp16,
                                 "allreduce_ms": seconds * 1e3})
    return rows


def slow_mode_excess(seconds: list[float]) -> tuple[float, int]:
    """How much longer the slow calls of a bimodal series take than the fast ones (median of
    each mode; a call is slow when it is more than 5 ms above the fastest quarter's median),
    and how many are slow."""
    ordered = sorted(seconds)
    fast_mode = statistics.median(ordered[:max(1, len(ordered) // 4)])
    slow = [t for t in ordered if t > fast_mode + 0.005]
    fast = [t for t in ordered if t <= fast_mode + 0.005]
    return (statistics.median(slow) - statistics.median(fast) if slow else 0.0), len(slow)


def markdown(result: dict) -> str:
    from benchmarks.report import measured_on

    where = measured_on(result["machine"])
    lines = [f"CNN gradient: {result['gradient_bytes'] / 2**20:.3f} MiB (float32), the largest "
             f"{result['largest_gradient_bytes'] / 2**20:.3f} MiB; 2 nodes x 1 rank; step = "
             "2 x 64 samples; window: horovod's allreduce window (timeline, rank 0)", "",
             "| link | variant | measured step (ms) | model (ms) | model error (paired) | "
             "window (ms) | model window (ms) | samples/s | measured on |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['rate']} | {row['variant']} | {row['measured_ms']:.1f} | "
                     f"{row['predicted_ms']:.1f} | {row['error']:+.1%} | "
                     f"{row['window_ms']:.1f} | {row['predicted_window_ms']:.1f} | "
                     f"{row['samples_per_sec']:.0f} | {where} |")
    lines += ["", "A 0.5 MiB horovod allreduce alone between the nodes at 100 Mbit/s, every call "
              "(ms):"]
    for variant, seconds in result["isolated_allreduce_0.5MiB_100Mbit_seconds"].items():
        lines.append(f"- {variant}: median {statistics.median(seconds) * 1e3:.1f}; "
                     + " ".join(f"{t * 1e3:.1f}" for t in seconds))
    fast, slow = slow_mode_excess(result["isolated_allreduce_0.5MiB_100Mbit_seconds"]["fp32"])
    lines.append(f"- fp32 calls in the slow mode: {slow}; they take {fast * 1e3:.1f} ms longer "
                 "than the fast mode (median); the model's handshake for this message: "
                 f"{result['isolated_handshake_model_ms']:.1f} ms")
    lines += ["", "| model | nodes x 8 GPUs | link | fp16 allreduce | allreduce per step (ms) |",
              "|---|---|---|---|---|"]
    for row in result["projections"]:
        lines.append(f"| {row['model']} | {row['nodes']} x 8 | {row['link_gbit']} Gbit/s | "
                     f"{'yes' if row['fp16'] else 'no'} | {row['allreduce_ms']:.3g} |")
    return "\n".join(lines)


def run(s: Settings, out: Path, log: Callable[[str], None]) -> dict | None:
    """The suite, or None (with a message) where it cannot run."""
    if os.geteuid() != 0:
        log("network: skipped: it needs root (network namespaces and tc for the local cluster)")
        return None
    was_up = cluster("status", check=False).returncode == 0
    # A CPU per node, as on separate hosts: sharing the cores, one node's busy-polling MPI
    # thread slowed the other node's computation in a third of the runs (docs/benchmarks.md).
    up = cluster("up", "--nodes", "2", "--pin-cpus", check=False)
    if up.returncode:
        raise BenchmarkFailed(f"tests/cluster/cluster-local.sh up failed:\n{up.stdout}{up.stderr}")
    try:
        with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-network-") as scratch:
            result = measure(s, Path(scratch), log)
    finally:
        limit_links(None)
        if was_up:
            # Left up, unpinned (a plain `up`, which also drops an --isolated-iface eth1).
            cluster("up", "--nodes", "2", check=False)
        else:
            cluster("down", check=False)
    from benchmarks.report import machine

    result["machine"] = machine()
    out.mkdir(parents=True, exist_ok=True)
    (out / "network.json").write_text(json.dumps(result, indent=1))
    (out / "network.md").write_text(markdown(result) + "\n")
    return result
