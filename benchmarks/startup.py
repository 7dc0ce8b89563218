"""Seconds outside the epochs: horovodrun's own start, a tiny job end to end, and a job's fixed
costs against a hand-written horovod Keras recipe (`python -m benchmarks startup`).

    launch   `horovodrun -np 2 true` against `mpirun -np 2 --oversubscribe true`: what horovodrun
             adds before any rank starts (its checks of horovod's build, its own imports)
    tiny     a 2-rank `hvdtrain.cnn --preset tiny` job of one 5-step epoch, started by horovodrun
             and by the launcher (`python -m hvdtrain.launch --np 2`): wall seconds to its exit
    recipe   hvdtrain (the default Keras) against benchmarks/recipe.py (horovod's Keras API on
             tf_keras, written as horovod's example is) on the same folder of PNG images, 2 ranks,
             the same batch, epochs and steps: wall seconds, the time outside the epochs (wall
             minus the epochs' own seconds: launch to the first epoch, the last epoch to exit) and
             the steady samples/s (epochs after the first)

Every variant is a separate command started as a user starts it, the variants of a comparison
interleaved (harness.interleave), medians over --repeats rounds after a warm-up round. Writes
startup.json and startup.md into --out.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from benchmarks.harness import Comparison, interleave
from benchmarks.suite import BIN, REPO, Settings, _env, _run, make_image_folder

#: The recipe comparison's job: as `bench scaling`'s, on the image folder.
RECIPE_EPOCHS, RECIPE_STEPS, RECIPE_BATCH, IMAGE_SIZE = 4, 40, 64, 32
TINY = ["--preset", "tiny", "--epochs", "1", "--steps-per-epoch", "5", "--no-export"]


def launch_run(command: list[str], s: Settings) -> dict:
    wall, _ = _run(command, s.timeout)
    return {"seconds": wall}


def tiny_run(s: Settings, workdir: Path, via: str) -> dict:
    run_dir = tempfile.mkdtemp(dir=workdir)
    job = ["-m", "hvdtrain.cnn", *TINY, "--run-dir", run_dir]
    if via == "horovodrun":
        command = [str(BIN / "horovodrun"), "-np", "2", sys.executable, *job]
    else:
        command = [sys.executable, "-m", "hvdtrain.launch", "--np", "2", "--", *job[1:]]
    wall, _ = _run(command, s.timeout)
    return {"seconds": wall}


def _outside_epochs(wall: float, epochs: list[dict]) -> dict:
    steady = epochs[1:] or epochs
    return {"seconds": wall, "outside_epochs": wall - sum(e["epoch_seconds"] for e in epochs),
            "samples_per_sec": statistics.median(e["samples_per_sec"] for e in steady)}


def hvdtrain_folder_run(s: Settings, workdir: Path, folder: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    wall, _ = _run([str(BIN / "horovodrun"), "-np", "2", sys.executable, "-m", "hvdtrain.cnn",
                    "--data-dir", str(folder), "--channels", "1", "--image-size", str(IMAGE_SIZE),
                    "--validation-fraction", "0", "--epochs", str(RECIPE_EPOCHS),
                    "--steps-per-epoch", str(RECIPE_STEPS), "--batch-size", str(RECIPE_BATCH),
                    "--warmup-epochs", "0", "--lr-decay", "constant", "--no-tensorboard",
                    "--no-export", "--run-dir", str(run_dir)], s.timeout)
    return _outside_epochs(wall, json.loads((run_dir / "metrics.json").read_text()))


def recipe_run(s: Settings, workdir: Path, folder: Path) -> dict:
    out = Path(tempfile.mkdtemp(dir=workdir)) / "recipe.json"
    wall, _ = _run([str(BIN / "horovodrun"), "-np", "2", sys.executable,
                    str(REPO / "benchmarks" / "recipe.py"), str(folder),
                    "--image-size", str(IMAGE_SIZE), "--epochs", str(RECIPE_EPOCHS),
                    "--steps-per-epoch", str(RECIPE_STEPS), "--batch-size", str(RECIPE_BATCH),
                    "--json", str(out)], s.timeout)
    return _outside_epochs(wall, json.loads(out.read_text())["epochs"])


def measure(s: Settings, workdir: Path, log: Callable[[str], None]) -> list[Comparison]:
    comparisons = []
    log("launch: horovodrun -np 2 true against mpirun -np 2 true")
    mpirun = ["mpirun", "-np", "2", "--oversubscribe", "true"]
    horovodrun = [str(BIN / "horovodrun"), "-np", "2", "true"]
    runs = interleave({"horovodrun": lambda: launch_run(horovodrun, s),
                       "mpirun": lambda: launch_run(mpirun, s)},
                      repeats=s.repeats, warmup=s.warmup, log=log)
    comparisons.append(Comparison(
        "horovodrun -np 2 true against mpirun -np 2 true", "seconds", "s", runs,
        "horovodrun", "mpirun", lower_is_better=True,
        note="issue 57: horovodrun within 1 s of mpirun (the difference, not this ratio)"))
    log("tiny: a 5-step 2-rank job through horovodrun and through the launcher")
    runs = interleave({"launcher": lambda: tiny_run(s, workdir, "launcher"),
                       "horovodrun": lambda: tiny_run(s, workdir, "horovodrun")},
                      repeats=s.repeats, warmup=s.warmup, log=log)
    comparisons.append(Comparison(
        "a 5-step 2-rank tiny job: the launcher against horovodrun", "seconds", "s", runs,
        "launcher", "horovodrun", lower_is_better=True))
    log("recipe: hvdtrain against a hand-written horovod Keras recipe, same folder and flags")
    folder = make_image_folder(workdir / "digits", IMAGE_SIZE)
    runs = interleave({"hvdtrain": lambda: hvdtrain_folder_run(s, workdir, folder),
                       "recipe": lambda: recipe_run(s, workdir, folder)},
                      repeats=s.repeats, warmup=s.warmup, log=log)
    for metric, unit, lower, target, note in (
            ("outside_epochs", "s", True, 1.0,
             "issue 57: hvdtrain's time outside its epochs no more than the recipe's"),
            ("seconds", "s", True, None, "launch to exit"),
            ("samples_per_sec", "samples/s", False, None, "epochs after the first")):
        comparisons.append(Comparison(
            f"hvdtrain against the horovod Keras recipe: {metric.replace('_', ' ')}", metric, unit,
            runs, "hvdtrain", "recipe", target=target, lower_is_better=lower, note=note))
    return comparisons


def markdown(result: dict) -> str:
    from benchmarks.report import measured_on

    lines = [f"Measured on {measured_on(result['machine'])} ({result['date']}); "
             f"{result['repeats']} interleaved rounds after {result['warmup']} warm-up.", "",
             "| comparison | variant | median | min - max | ratio (medians) | target |",
             "|---|---|---|---|---|---|"]
    for data in result["comparisons"]:
        comparison = Comparison.from_dict(data)
        for position, name in enumerate((comparison.numerator, comparison.denominator)):
            summary = comparison.summaries[name]
            ratio = target = ""
            if position == 0:
                ratio = f"{comparison.result.of_medians:.2f}"
                if comparison.target is not None:
                    target = (f"{'<=' if comparison.lower_is_better else '>='} "
                              f"{comparison.target:g}: {'met' if comparison.met else 'missed'}")
            lines.append(f"| {comparison.name if position == 0 else ''} | {name} | "
                         f"{summary.median:.3g} {comparison.unit} | {summary.minimum:.3g} - "
                         f"{summary.maximum:.3g} | {ratio} | {target} |")
    return "\n".join(lines)


def run(s: Settings, out: Path, log: Callable[[str], None], *, quick: bool = False) -> dict:
    from benchmarks.report import machine

    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-startup-") as scratch:
        comparisons = measure(s, Path(scratch), log)
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "repeats": s.repeats, "warmup": s.warmup,
              "comparisons": [c.to_dict() for c in comparisons]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps(result, indent=1))
    (out / "startup.md").write_text(markdown(result) + "\n")
    return result
