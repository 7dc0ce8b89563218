"""Benchmark results as JSON (everything measured), a markdown table and PNG plots."""
from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from benchmarks.harness import Comparison
from hvdtrain.plots import pyplot, save_figure
from hvdtrain.rundir import RunDir


def machine() -> dict:
    def first_line(argv: list[str]) -> str:
        try:
            output = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            return (output.stdout or output.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "unknown"

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    # TensorFlow is installed as tensorflow-cpu on CPU machines, tensorflow-tpu on TPU VMs.
    distributions = {"tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-tpu"),
                     "tf_keras": ("tf_keras",), "keras": ("keras",), "horovod": ("horovod",),
                     "mpi4py": ("mpi4py",), "numpy": ("numpy",)}
    for module, names in distributions.items():
        versions[module] = "missing"
        for name in names:
            try:
                versions[module] = version(name)
                break
            except PackageNotFoundError:
                pass
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu, "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
                                1),
            "kernel": platform.release(), "python": platform.python_version(),
            "openmpi": first_line(["mpirun", "--version"]), **versions}


def measured_on(host: dict) -> str:
    """The machine and day a result belongs to, for the row beside it: results from different
    machines (a bench CPU differs between sessions) must never be read as one series."""
    return f"{host['cpu']}, {host['cores']} cores, {host['date'][:10]}"


def markdown(comparisons: list[Comparison], speedup: dict | None, host: dict) -> str:
    where = measured_on(host)
    lines = ["| comparison | variant A | median A | variant B | median B | A/B (medians) | "
             "A/B (paired median) | spread A, B | target | met | measured on |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        a, b = c.summaries[c.numerator], c.summaries[c.denominator]
        target = "" if c.target is None else ("≤ " if c.lower_is_better else "≥ ") + f"{c.target:g}"
        met = {True: "yes", False: "**no**", None: ""}[c.met]
        lines.append(
            f"| {c.name} | {c.numerator} | {a.median:.4g} {c.unit} | {c.denominator} | "
            f"{b.median:.4g} {c.unit} | {c.result.of_medians:.3f} | "
            f"{c.result.paired_median:.3f} | {a.spread:.0%}, {b.spread:.0%} | {target} | {met} | "
            f"{where} |")
    if speedup:
        lines += ["", "| workers | speedup over 1 | efficiency | measured on |",
                  "|---|---|---|---|"]
        lines += [f"| {n} | {value:.2f}x | {value / int(n):.0%} | {where} |"
                  for n, value in speedup["speedup"].items()]
    return "\n".join(lines) + "\n"


def write(out: Path, settings: dict, comparisons: list[Comparison], speedup: dict | None,
          allreduce_rounds: dict | None, extra: dict | None = None) -> str:
    """Write results.json, results.md and the plots into ``out``; return results.md's text."""
    results = RunDir(out, is_chief=True)  # atomic writes, like a training run's outputs
    host = machine()
    data = {"machine": host, "settings": settings,
            "comparisons": [{**c.to_dict(), "measured_on": measured_on(host)} for c in comparisons],
            "speedup_vs_workers": speedup, "allreduce_raw": allreduce_rounds, **(extra or {})}
    results.write_json("results.json", data)
    table = markdown(comparisons, speedup, host)
    results.write_text("results.md", table)
    if any(c.target is not None for c in comparisons):
        results.write_with("ratios.png", lambda path: plot_ratios(comparisons, path))
    allreduce = [c for c in comparisons if c.name.startswith("allreduce ")]
    if allreduce:
        results.write_with("allreduce.png", lambda path: plot_allreduce(allreduce, path))
    if speedup:
        results.write_with("speedup.png", lambda path: plot_speedup(speedup, path))
    return table


def plot_ratios(comparisons: list[Comparison], path: str) -> None:
    plt = pyplot()
    rows = [c for c in comparisons if c.target is not None]
    figure, axis = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    for index, c in enumerate(rows):
        paired = c.result.paired
        axis.plot([min(paired), max(paired)], [index, index], color="0.6")
        axis.plot(c.result.of_medians, index, "o", color="tab:green" if c.met else "tab:red")
        axis.plot(c.target, index, "|", color="black", markersize=14)
    axis.set_yticks(range(len(rows)), [c.name for c in rows])
    axis.set_xlabel("ratio A/B: dot = ratio of medians, line = range of per-round ratios, "
                    "| = target")
    axis.grid(axis="x", alpha=0.3)
    save_figure(figure, path)


def plot_allreduce(comparisons: list[Comparison], path: str) -> None:
    plt = pyplot()
    sizes = [float(c.name.split()[1]) for c in comparisons]
    figure, axis = plt.subplots(figsize=(7, 4))
    for variant in comparisons[0].summaries:
        axis.plot(sizes, [c.summaries[variant].median for c in comparisons], marker="o",
                  label=variant)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("buffer (MiB, fp32)")
    axis.set_ylabel("GB/s (algorithm bandwidth, median)")
    axis.set_title("2-rank allreduce on this machine")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    save_figure(figure, path)


def plot_speedup(speedup: dict, path: str) -> None:
    """In the style of the source article's figure: speedup against the number of workers."""
    plt = pyplot()
    workers = [int(n) for n in speedup["speedup"]]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(workers, list(speedup["speedup"].values()), marker="o",
              label="hvdtrain on this 2-core machine")
    axis.plot(workers, workers, "--", color="0.5", label="ideal")
    textbook = {1: 1.0, 2: 2.0, 4: 3.8, 8: 7.3}
    axis.plot([n for n in textbook if n <= max(workers)],
              [v for n, v in textbook.items() if n <= max(workers)], ":", color="tab:orange",
              label="textbook GPU figures (2: 2x, 4: 3.8x)")
    axis.set_xlabel("workers (ranks, 1 thread each)")
    axis.set_ylabel("speedup over 1 worker (samples/s)")
    axis.set_xticks(workers)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    save_figure(figure, path)
