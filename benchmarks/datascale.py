"""What the input costs as the data set grows: image folders and TFRecords, 1k to 1.28 M files.

`python -m benchmarks data`. Each size is a folder of hard links to a small set of distinct
images (so 1.28 M files cost seconds to make and no disk), in ImageNet's shape: 1000 class folders
from 10k files up. The same folder converted by `python -m hvdtrain.tfrecords` (1024 shards
at 1.28 M, like ImageNet's) is the TFRecord source. Every job is `horovodrun -np 2 python -m
hvdtrain.cnn` with `--validation-fraction 0.001`.

* **To the end of a 5-step epoch** (one run per size and source, page cache dropped first when
  root, as a job after another job's data would find it): the job's wall time from `horovodrun`
  to exit, the listing time the banner reports, the time to the first step (metrics), and the
  peak resident memory of every rank (each prints its own ``ru_maxrss`` at exit).
* **Memory over epochs** (10k files at 128x128, 4 complete passes, `--cache memory` against
  `--cache disk`, which `auto` picks for data larger than the node's budget): rank 0's resident
  memory at the end of every epoch (metrics.json's ``resident_mb``); flat means from the end of
  the second pass (the first to replay the cache) to the end of the last.
* **Steady samples/s**: 10k against 1.28 M files, interleaved rounds, median of each run's later
  epochs (the first includes tracing). Every measured step still reads and decodes new files at
  both sizes (neither size finishes a pass), so the comparison is of the same work.

Targets (issue 14): 1.28 M files reach the end of the 5-step epoch in <= 30 s with every process
under 2 GB resident; steady samples/s at 1.28 M within 10% of 10k; resident memory flat over
epochs with the disk cache (within 50 MB or a fifth of the decoded share, whichever is larger).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from benchmarks.harness import interleave
from benchmarks.suite import BIN, BenchmarkFailed, Settings, _run

SIZES = (1_000, 10_000, 100_000, 1_281_167)
QUICK_SIZES = (1_000, 10_000)
DISTINCT_IMAGES = 64
IMAGE_SIZE = 64
BATCH_SIZE = 32
TARGET_SECONDS = 30.0
TARGET_RSS_MB = 2000.0
TARGET_RATE_RATIO = 0.9
PEAK_RSS = re.compile(r"peak resident memory: (\d+) MB")


def classes_for(size: int) -> int:
    """1000 classes (ImageNet's) from 10k files up: the steady comparison of 10k against 1.28 M
    must train the same model, and the CNN's last layer grows with the class count."""
    return 1000 if size >= 10_000 else max(2, size // 100)


def make_textures(directory: Path, count: int) -> list[Path]:
    """``count`` distinct 64x64 images, half PNG, half JPEG (smooth noise: real decode work)."""
    import numpy as np
    import tensorflow as tf

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for index in range(count):
        coarse = rng.integers(0, 256, size=(8, 8, 3)).astype("float32")
        image = tf.cast(tf.image.resize(coarse, [IMAGE_SIZE, IMAGE_SIZE]), tf.uint8)
        if index % 2:
            path, encoded = directory / f"{index}.jpg", tf.io.encode_jpeg(image, quality=90)
        else:
            path, encoded = directory / f"{index}.png", tf.io.encode_png(image)
        path.write_bytes(encoded.numpy())
        paths.append(path)
    return paths


def make_folder(root: Path, size: int, textures: list[Path]) -> Path:
    """``size`` hard links in ``classes_for(size)`` class folders."""
    classes = classes_for(size)
    for label in range(classes):
        (root / f"class{label:04d}").mkdir(parents=True, exist_ok=True)
    for index in range(size):
        label = index % classes
        texture = textures[index % len(textures)]  # evenly: a file has at most 65000 links
        os.link(texture, root / f"class{label:04d}" / f"img{index:07d}{texture.suffix}")
    return root


def convert(folder: Path, out: Path, size: int, log: Callable[[str], None]) -> float:
    shards = 1024 if size >= 1_000_000 else max(4, size // 1000)
    seconds, _ = _run([sys.executable, "-m", "hvdtrain.tfrecords", "--data-dir", str(folder),
                       "--out", str(out), "--shards", str(shards), "--validation-fraction",
                       "0.001", "--image-size", str(IMAGE_SIZE), "--quiet"], timeout=7200)
    log(f"  converted {size} files to {shards} shards in {seconds:.0f} s")
    return seconds


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def job(source: list[str], run_dir: Path, *, steps: int, epochs: int,
        timeout: float, image_size: int = IMAGE_SIZE) -> dict:
    """One `horovodrun -np 2` CNN job: wall, listing, first step, samples/s, peak RSS per rank,
    and rank 0's resident memory at the end of each epoch."""
    shutil.rmtree(run_dir, ignore_errors=True)
    wall, output = _run([str(BIN / "horovodrun"), "-np", "2", sys.executable, "-m",
                         "benchmarks.peakrss", "hvdtrain.cnn", *source,
                         "--image-size", str(image_size), "--validation-fraction", "0.001",
                         "--batch-size", str(BATCH_SIZE), "--steps-per-epoch", str(steps),
                         "--epochs", str(epochs), "--warmup-epochs", "0",
                         "--no-tensorboard", "--no-export", "--run-dir", str(run_dir)],
                        timeout)
    rows = json.loads((run_dir / "metrics.json").read_text())
    listed = re.search(r"listed in ([\d.]+) s", output)
    cache = re.search(r"cache: (\w+)", output)
    return {"wall_seconds": wall,
            "listing_seconds": float(listed.group(1)) if listed else None,
            "first_step_seconds": rows[0].get("first_step_seconds"),
            "samples_per_sec": statistics.median(r["samples_per_sec"] for r in rows[1:] or rows),
            "peak_rss_mb": [int(m) for m in PEAK_RSS.findall(output)],
            "resident_mb_by_epoch": [round(row["resident_mb"]) for row in rows
                                     if "resident_mb" in row],
            "cache": cache.group(1) if cache else None}


def memory_over_epochs(s: Settings, folder: Path, size: int, workdir: Path,
                       log: Callable[[str], None], *, image_size: int = 128,
                       epochs: int = 4) -> dict:
    """Rank 0's resident memory after each of ``epochs`` complete passes over ``size`` files at
    ``image_size``, with the decoded images cached in memory and on disk (what `auto` picks when
    they do not fit). The memory cache holds this rank's decoded share from the first pass on; with
    either cache, memory must not grow once every pass is the same work (see ``flatness``)."""
    per_rank = int(size * (1 - 0.001)) // 2
    steps = per_rank // BATCH_SIZE
    decoded_mb = per_rank * image_size * image_size * 3 / 2**20
    result = {"files": size, "image_size": image_size, "epochs": epochs, "steps_per_epoch": steps,
              "decoded_mb_per_rank": decoded_mb, "by_cache": {}}
    for cache in ("memory", "disk"):
        row = job(["--data-dir", str(folder), "--cache", cache], workdir / "run", steps=steps,
                  epochs=epochs, timeout=s.timeout, image_size=image_size)
        result["by_cache"][cache] = row
        log(f"  memory over {epochs} passes, cache {cache}: rank 0 resident "
            f"{row['resident_mb_by_epoch']} MB after each epoch, peak {row['peak_rss_mb']} MB")
    return result


def measure(s: Settings, workdir: Path, log: Callable[[str], None], sizes: tuple[int, ...],
            quick: bool = False) -> dict:
    textures = make_textures(workdir / "textures", DISTINCT_IMAGES)
    sources: dict[str, dict[int, list[str]]] = {"image folder": {}, "TFRecords": {}}
    preparation = {}
    for size in sizes:
        started = time.perf_counter()
        folder = make_folder(workdir / f"folder-{size}", size, textures)
        linked = time.perf_counter() - started
        converted = convert(folder, workdir / f"records-{size}", size, log)
        preparation[size] = {"link_seconds": linked, "convert_seconds": converted}
        sources["image folder"][size] = ["--data-dir", str(folder)]
        sources["TFRecords"][size] = ["--tfrecords", str(workdir / f"records-{size}")]
        log(f"  {size} files: linked in {linked:.1f} s")

    to_first_epoch: dict[str, dict[int, dict]] = {name: {} for name in sources}
    cold = False
    for size in sizes:
        for name, by_size in sources.items():
            cold = drop_page_cache()
            result = job(by_size[size], workdir / "run", steps=5, epochs=1, timeout=s.timeout)
            to_first_epoch[name][size] = result
            log(f"  {name} {size}: {result['wall_seconds']:.1f} s to the end of 5 steps, "
                f"listed in {result['listing_seconds']} s, first step "
                f"{result['first_step_seconds']:.1f} s, peak RSS {result['peak_rss_mb']} MB, "
                f"cache {result['cache']}")

    over_size = sizes[0] if quick else 10_000
    over_epochs = memory_over_epochs(s, workdir / f"folder-{over_size}", over_size, workdir, log,
                                     image_size=32 if quick else 128, epochs=3 if quick else 4)

    small, large = 10_000, sizes[-1]
    steady = {}
    if small in sizes and large != small:
        for name, by_size in sources.items():
            runs = interleave({
                f"{size} files": (lambda size=size: job(
                    by_size[size], workdir / "run", steps=s.steps_per_epoch, epochs=3,
                    timeout=s.timeout)) for size in (small, large)},
                repeats=s.repeats, warmup=0)
            steady[name] = {variant: [r["samples_per_sec"] for r in results]
                            for variant, results in runs.items()}
            log(f"  {name} steady samples/s: " + ", ".join(
                f"{v} {statistics.median(rates):.0f}" for v, rates in steady[name].items()))
    return {"sizes": list(sizes), "batch_size_per_rank": BATCH_SIZE, "image_size": IMAGE_SIZE,
            "cold_page_cache": cold, "preparation": preparation,
            "to_first_epoch": to_first_epoch, "memory_over_epochs": over_epochs,
            "steady_samples_per_sec": steady,
            "steady_sizes": [small, large]}


def verdicts(result: dict) -> list[str]:
    lines = []
    large = result["sizes"][-1]
    for name, by_size in result["to_first_epoch"].items():
        row = by_size[str(large)] if str(large) in by_size else by_size[large]
        rss = max(row["peak_rss_mb"] or [float("nan")])
        lines.append(f"{name}, {large} files: end of a 5-step epoch in {row['wall_seconds']:.1f} s "
                     f"(target <= {TARGET_SECONDS:.0f} s: "
                     f"{'met' if row['wall_seconds'] <= TARGET_SECONDS else 'MISSED'}); "
                     f"largest rank {rss:.0f} MB resident (target < {TARGET_RSS_MB:.0f} MB: "
                     f"{'met' if rss < TARGET_RSS_MB else 'MISSED'})")
    over = result.get("memory_over_epochs")
    if over:
        growth = flatness(over)
        allowed = max(50.0, over["decoded_mb_per_rank"] / 5)
        disk = growth.get("disk", float("nan"))
        lines.append(f"disk cache, {over['files']} files at {over['image_size']}x"
                     f"{over['image_size']} ({over['decoded_mb_per_rank']:.0f} MB decoded per "
                     f"rank), {over['epochs']} passes: rank 0's resident memory changed by "
                     f"{disk:+.0f} MB from the second epoch's end to the last (memory cache: "
                     f"{growth.get('memory', float('nan')):+.0f} MB; target within "
                     f"{allowed:.0f} MB: {'met' if abs(disk) <= allowed else 'MISSED'})")
    for name, rates in result["steady_samples_per_sec"].items():
        small, large_rates = (statistics.median(values) for values in rates.values())
        ratio = large_rates / small
        lines.append(f"{name}: steady samples/s at {large} files / at 10000 = {ratio:.3f} "
                     f"(target >= {TARGET_RATE_RATIO}: "
                     f"{'met' if ratio >= TARGET_RATE_RATIO else 'MISSED'})")
    return lines


def flatness(over: dict) -> dict[str, float]:
    """Per cache: rank 0's resident memory at the last epoch's end minus at the second's. The
    first pass fills the cache and the second is the first to replay it; from then on every pass
    is the same work and memory must not grow."""
    return {cache: row["resident_mb_by_epoch"][-1] - row["resident_mb_by_epoch"][1]
            for cache, row in over["by_cache"].items() if len(row["resident_mb_by_epoch"]) > 1}


def markdown(result: dict) -> str:
    lines = ["| source | files | listing s | first step s | end of 5 steps s | peak RSS per "
             "rank MB | cache |", "|---|---:|---:|---:|---:|---|---|"]
    for name, by_size in result["to_first_epoch"].items():
        for size, row in by_size.items():
            listed = "-" if row["listing_seconds"] is None else row["listing_seconds"]
            lines.append(f"| {name} | {int(size):,} | {listed} | "
                         f"{row['first_step_seconds']:.1f} | {row['wall_seconds']:.1f} | "
                         f"{', '.join(map(str, row['peak_rss_mb']))} | {row['cache']} |")
    over = result.get("memory_over_epochs")
    if over:
        epochs = range(1, over["epochs"] + 1)
        lines += ["", f"Rank 0's resident memory (MB) at the end of each complete pass, "
                  f"{over['files']} files at {over['image_size']}x{over['image_size']}:", "",
                  "| cache | " + " | ".join(f"epoch {e}" for e in epochs) + " | peak per rank |",
                  "|---|" + "---:|" * over["epochs"] + "---|"]
        for cache, row in over["by_cache"].items():
            lines.append(f"| {cache} | " + " | ".join(map(str, row["resident_mb_by_epoch"]))
                         + f" | {', '.join(map(str, row['peak_rss_mb']))} |")
    if result["steady_samples_per_sec"]:
        lines += ["", "| source | variant | samples/s per round | median |", "|---|---|---|---:|"]
        for name, rates in result["steady_samples_per_sec"].items():
            for variant, values in rates.items():
                lines.append(f"| {name} | {variant} | {', '.join(f'{v:.0f}' for v in values)} | "
                             f"{statistics.median(values):.0f} |")
    lines += ["", *(f"- {line}" for line in verdicts(result))]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    from hvdtrain.plots import pyplot

    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, by_size in result["to_first_epoch"].items():
        sizes = [int(size) for size in by_size]
        axes[0].plot(sizes, [row["wall_seconds"] for row in by_size.values()], "o-", label=name)
        axes[1].plot(sizes, [max(row["peak_rss_mb"] or [0]) for row in by_size.values()], "o-",
                     label=name)
    axes[0].axhline(TARGET_SECONDS, color="grey", linestyle="--", label="target")
    axes[1].axhline(TARGET_RSS_MB, color="grey", linestyle="--", label="target")
    for axis, title in zip(axes, ("end of a 5-step epoch (s), 2 ranks",
                                  "peak resident memory of a rank (MB)")):
        axis.set_xscale("log")
        axis.set_xlabel("files")
        axis.set_title(title)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def run(s: Settings, out: Path, log: Callable[[str], None], *, quick: bool = False,
        workdir: Path | None = None) -> dict:
    sizes = QUICK_SIZES if quick else SIZES
    parent = workdir or Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-data-", dir=parent) as scratch:
        result = measure(s, Path(scratch), log, sizes, quick)
    from benchmarks.report import machine

    result["machine"] = machine()
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.json").write_text(json.dumps(result, indent=1))
    (out / "data.md").write_text(markdown(result) + "\n")
    plot(result, out / "data.png")
    return result
