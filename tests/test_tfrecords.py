"""The TFRecord converter for real: worker processes, bad files, interruption and resume.

Integration tests: they start worker processes and converter runs of their own (skipped under
mpirun, where every rank would start them at once on the same cores).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_env, integration
from hvdtrain.errors import UserError
from hvdtrain.tfrecords import DONE_DIR, convert, staging_dir
from images import make_image_folder
from processes import live_processes_in_group, process_group

pytestmark = integration

RUN_TIMEOUT = 120
"""Seconds any converter run may take on a loaded 2-core machine (a normal one takes ~5)."""


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """120 small PNG/JPEG files in 3 classes."""
    return make_image_folder(tmp_path_factory.mktemp("images") / "digits", classes=3,
                             per_class=40)


@pytest.fixture(scope="module")
def many_images(tmp_path_factory, images) -> Path:
    """60,000 files (hard links of the 120), enough for a run to take seconds, not milliseconds."""
    root = tmp_path_factory.mktemp("many") / "folder"
    originals = sorted(images.glob("*/*"))
    for index in range(60_000):
        original = originals[index % len(originals)]
        folder = root / original.parent.name
        folder.mkdir(parents=True, exist_ok=True)
        os.link(original, folder / f"{index:05d}{original.suffix}")
    return root


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.glob("*.tfrecord"))}


def records_of(out: Path) -> list[tuple[int, bytes]]:
    """(label, image bytes) of every record of every shard."""
    import tensorflow as tf

    from hvdtrain.data.records import parse_example

    records = tf.data.TFRecordDataset(sorted(map(str, out.glob("*.tfrecord")))).map(
        parse_example)
    return [(int(label), bytes(image)) for image, label in records.as_numpy_iterator()]


def test_two_workers_write_the_shards_one_writes(images, tmp_path):
    # --image-size 40: its default --max-resolution (46) is over every file's size (24 to 40),
    # so each is stored as it is.
    common = dict(shards=4, validation_shards=2, validation_fraction=0.2, seed=3, image_size=40)
    one = convert(str(images), str(tmp_path / "one"), workers=1, **common)
    two = convert(str(images), str(tmp_path / "two"), workers=2, **common)
    assert one == two and sum(one["counts"].values()) == 120 and one["skipped"] == []
    assert shard_bytes(tmp_path / "one") == shard_bytes(tmp_path / "two")
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "dataset.json", "train-00000-of-00004.tfrecord", "train-00001-of-00004.tfrecord",
        "train-00002-of-00004.tfrecord", "train-00003-of-00004.tfrecord",
        "validation-00000-of-00002.tfrecord", "validation-00001-of-00002.tfrecord"]
    # Every file once, bytes unchanged, labelled with its class folder's index.
    classes = sorted(p.name for p in images.iterdir())
    expected = sorted((classes.index(path.parent.name), path.read_bytes())
                      for path in images.glob("*/*"))
    assert sorted(records_of(tmp_path / "two")) == expected


def test_a_file_that_is_no_image_is_skipped_or_fails(images, tmp_path):
    folder = tmp_path / "images"
    for path in images.glob("*/*"):
        (folder / path.parent.name).mkdir(parents=True, exist_ok=True)
        os.link(path, folder / path.parent.name / path.name)
    bad = folder / "one" / "notes.png"
    bad.write_text("not an image, whatever the name says")
    common = dict(shards=3, validation_shards=1, validation_fraction=0.2, seed=0, image_size=8)
    metadata = convert(str(folder), str(tmp_path / "skipped"), **common)
    assert sum(metadata["counts"].values()) == 120
    written = json.loads((tmp_path / "skipped" / "dataset.json").read_text())
    assert written["counts"] == metadata["counts"]
    assert written["skipped"] == [f"skipped 1 file(s) in {folder} that are not readable "
                                  f"PNG/JPEG/GIF/BMP images (first: {bad})"]
    # Failing, in a worker process: one line, and no output, finished or partial.
    with pytest.raises(UserError, match=f"^{re.escape(str(bad))} is not a readable "
                                        "PNG/JPEG/GIF/BMP image; remove it or pass "
                                        "--on-bad-image skip$"):
        convert(str(folder), str(tmp_path / "failed"), on_bad_image="fail", workers=2, **common)
    assert not (tmp_path / "failed").exists()
    assert not Path(staging_dir(str(tmp_path / "failed"))).exists()


def test_images_over_max_resolution_are_stored_resized_the_rest_unchanged(tmp_path):
    """A shorter side over the limit: a JPEG of that shorter side, aspect ratio kept, RGB or
    gray, alpha dropped as TensorFlow drops it; at or under it: the file's bytes."""
    import numpy as np
    from PIL import Image

    folder = tmp_path / "images"
    pictures = {  # name: (picture, what is stored: format, mode, size, pixel)
        "a/wide.jpg": (Image.new("RGB", (200, 150), (20, 140, 220)),
                       ("JPEG", "RGB", (85, 64), (20, 140, 220))),
        # Transparent: TensorFlow decodes its colour, which is what is stored.
        "a/tall.png": (Image.new("RGBA", (90, 240), (200, 30, 60, 0)),
                       ("JPEG", "RGB", (64, 171), (200, 30, 60))),
        "a/deep.png": (Image.fromarray(np.full((96, 128), 0x8040, np.uint16)),
                       ("JPEG", "L", (85, 64), 128)),
        "b/palette.gif": (palette_image((150, 100), (240, 200, 0)),
                          ("JPEG", "RGB", (96, 64), (240, 200, 0))),
        "b/small.jpg": (Image.new("RGB", (60, 40), (90, 90, 90)), None),
        "b/limit.png": (Image.new("L", (64, 300), 7), None),
    }
    for name, (picture, _) in pictures.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        picture.save(folder / name)
    # Over the limit, with a good header but cut short: its pixels do not decode.
    whole = folder / "a" / "wide.jpg"
    (folder / "a" / "cut.jpg").write_bytes(whole.read_bytes()[:len(whole.read_bytes()) // 2])
    common = dict(shards=1, validation_shards=1, validation_fraction=0.0, seed=0, workers=1)
    metadata = convert(str(folder), str(tmp_path / "limited"), image_size=16, max_resolution=64,
                       jpeg_quality=85, **common)
    assert metadata["max_resolution"] == {"shorter_side": 64, "jpeg_quality": 85, "resized": 4}
    written = json.loads((tmp_path / "limited" / "dataset.json").read_text())
    assert written["max_resolution"] == metadata["max_resolution"]
    assert written["skipped"] == [f"skipped 1 file(s) in {folder} that are not readable "
                                  f"PNG/JPEG/GIF/BMP images (first: {folder / 'a' / 'cut.jpg'})"]
    # Records are in the split's seeded order: each is matched to its file by label and content.
    stored = records_of(tmp_path / "limited")
    assert len(stored) == 6
    for name, (_, resized) in pictures.items():
        label = "ab".index(name[0])
        original = (folder / name).read_bytes()
        if resized is None:
            assert (label, original) in stored, name
            continue
        matches = []
        for record_label, encoded in stored:
            image = Image.open(io.BytesIO(encoded))
            if record_label == label and (image.format, image.mode, image.size) == resized[:3]:
                matches.append(np.asarray(image).astype(int))
        assert len(matches) == 1, (name, len(matches))
        assert np.abs(matches[0] - np.array(resized[3])).max() <= 2, name
    # The default: what training at --image-size decodes to with --augment (48 / 0.875 = 55),
    # under limit.png's 64 too.
    default = convert(str(folder), str(tmp_path / "default"), image_size=48, **common)
    assert default["max_resolution"] == {"shorter_side": 55, "jpeg_quality": 90, "resized": 5}
    # off: every file as it is (the cut one too: nothing decodes it).
    off = convert(str(folder), str(tmp_path / "off"), image_size=48, max_resolution=0, **common)
    assert off["max_resolution"] is None and off["skipped"] == []
    assert sorted(records_of(tmp_path / "off")) == sorted(
        ("ab".index(path.parent.name), path.read_bytes()) for path in folder.glob("*/*"))


def palette_image(size: tuple[int, int], colour: tuple[int, int, int]):
    """A one-colour palette ("P") image, as a GIF stores it."""
    from PIL import Image

    image = Image.new("P", size, 0)
    image.putpalette(list(colour) + [0] * 765)
    return image


def converter(folder: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "hvdtrain.tfrecords", "--data-dir", str(folder), "--out",
            str(out), "--shards", "480", "--validation-shards", "120", *args]


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)


@pytest.fixture
def start():
    """Start a command in a session of its own: signals can go to its whole process group, as a
    terminal's Ctrl-C does, and the group shows which of its processes are still alive. Whatever
    a failed test leaves of the groups is killed."""
    with contextlib.ExitStack() as groups:
        def started(command: list[str]) -> subprocess.Popen:
            return groups.enter_context(process_group(
                command, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True))

        yield started


def complete_shards(staging: Path) -> set[str]:
    return {marker.name[:-len(".json")] for marker in (staging / DONE_DIR).glob("*.tfrecord.json")}


def wait_for_complete_shards(process: subprocess.Popen, staging: Path, more_than: int) -> None:
    """Until more than ``more_than`` shards are complete; fails when the run ends or stalls."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while len(complete_shards(staging)) <= more_than:
        if process.poll() is not None:
            pytest.fail(f"the converter ended (exit {process.returncode}) before it could be "
                        f"interrupted:\n{process.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no more than {more_than} shard(s) complete in {staging} after "
                        f"{RUN_TIMEOUT} s")
        time.sleep(0.005)


def wait_until_group_ends(group: int) -> None:
    """Until no process of the group is left (the converter has ended already)."""
    deadline = time.monotonic() + 10
    while live := live_processes_in_group(group):
        assert time.monotonic() < deadline, f"processes {live} outlived their converter by 10 s"
        time.sleep(0.05)


def test_interrupted_runs_resume_to_the_shards_of_a_clean_run(images, many_images, tmp_path,
                                                               start):
    clean = run(converter(many_images, tmp_path / "clean", "--workers", "1", "--quiet"))
    assert clean.returncode == 0, clean.stderr
    assert clean.stderr == ""  # --quiet: no progress
    out = tmp_path / "resumed"
    staging = Path(staging_dir(str(out)))

    # Ctrl-C (to the process group, as a terminal sends it): a prompt exit, one line.
    process = start(converter(many_images, out, "--workers", "2"))
    wait_for_complete_shards(process, staging, more_than=0)
    os.killpg(process.pid, signal.SIGINT)
    interrupted = time.monotonic()
    _, stderr = process.communicate(timeout=RUN_TIMEOUT)
    assert time.monotonic() - interrupted < 10
    assert process.returncode == 130
    assert stderr.splitlines()[-1] == (f"hvdtrain.tfrecords: interrupted; rerun the same command "
                                       f"to resume from {staging}")
    assert "Traceback" not in stderr
    wait_until_group_ends(process.pid)  # the workers, and multiprocessing's resource tracker

    # SIGKILL of the converter alone: its workers notice and exit by themselves. Meanwhile the
    # same command again is refused in one line: it used to "resume" the running one, removing
    # the shards in flight.
    before = len(complete_shards(staging))
    process = start(converter(many_images, out, "--workers", "2"))
    wait_for_complete_shards(process, staging, more_than=before)
    second = run(converter(many_images, out, "--workers", "1"))
    assert second.returncode == 2 and second.stderr.splitlines() == [
        f"hvdtrain.tfrecords: error: another converter is writing {staging} now; wait for it "
        "to finish, or write elsewhere with another --out"], second.stderr
    process.kill()
    process.communicate(timeout=RUN_TIMEOUT)
    wait_until_group_ends(process.pid)

    # Other arguments are refused, in one line naming the staging directory: another seed, or
    # another size limit (the default for --image-size 64 is 73, the shards stored at that).
    for flags, difference in ((["--seed", "7"], "seed 42 then, 7 now"),
                              (["--max-resolution", "off"], "max_resolution 73 then, off now; "
                                                            "jpeg_quality 90 then, off now")):
        refused = run(converter(many_images, out, *flags))
        assert refused.returncode == 2
        assert refused.stderr.splitlines() == [
            f"hvdtrain.tfrecords: error: {staging} holds an unfinished conversion of other data "
            f"or arguments ({difference}): rerun with the original arguments to resume it, or "
            f"delete {staging} to start over"]

    # Images changed in place since the interrupted run stored them (here: every file's
    # modification time, through the 120 originals the folder links): refused, naming one.
    originals = {path: path.stat() for path in images.glob("*/*")}
    for path, stat in originals.items():
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed = run(converter(many_images, out))
    for path, stat in originals.items():
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert changed.returncode == 2 and re.fullmatch(
        rf"hvdtrain.tfrecords: error: {re.escape(str(many_images))}/\w+/\d+\.(png|jpg) changed "
        rf"\(size or modification time\) since the interrupted run stored it in "
        rf"{re.escape(str(staging))}; delete {re.escape(str(staging))} to start over",
        changed.stderr.strip()), changed.stderr
    # A done marker left empty (a full disk as it was written): its shard is written again.
    emptied = sorted(complete_shards(staging))[0]
    (staging / DONE_DIR / f"{emptied}.json").write_text("")

    # The same command resumes: the complete shards stay as they are (same files), the rest are
    # written, and the result is byte for byte the clean run's.
    kept = {name: (staging / name).stat().st_ino for name in complete_shards(staging)
            if name != emptied}
    assert 0 < len(kept) < 600
    resumed = run(converter(many_images, out, "--workers", "2"))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[0] == (f"resuming {staging}: {len(kept)} of 600 shards "
                                              "were complete")
    assert {name: (out / name).stat().st_ino for name in kept} == kept
    assert shard_bytes(out) == shard_bytes(tmp_path / "clean")
    assert (json.loads((out / "dataset.json").read_text())
            == json.loads((tmp_path / "clean" / "dataset.json").read_text()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean", "resumed"]
    # Progress on a pipe: plain lines, the first at once, the last with the totals.
    lines = resumed.stderr.splitlines()
    assert re.fullmatch(r"\d+/60000 records \(\d+%\) \| 0 records/s \| ETA --", lines[0]), lines
    assert re.fullmatch(r"60000/60000 records \(100%\) \| \d+ records/s \| 0m\d\ds elapsed",
                        lines[-1]), lines
    assert re.fullmatch(rf"wrote 60000 records in 600 shards to {re.escape(str(out))} in "
                        rf"[\d.]+ s \(\d+ records/s; {len(kept)} shard\(s\) came from the "
                        r"interrupted run\)", resumed.stdout.splitlines()[-1]), resumed.stdout


def test_a_shard_cut_short_is_refused_by_name_before_training(images, tmp_path):
    """An interrupted copy: one shard truncated to 60%. It trained with its missing records
    counted as images that did not decode ("13 sample(s) did not decode", exit 0); now the job
    stops before training, in one line naming the shard."""
    out = tmp_path / "shards"
    metadata = convert(str(images), str(out), shards=2, validation_shards=1,
                       validation_fraction=0.2, seed=3, image_size=16, workers=1)
    assert metadata["bytes"] == {path.name: path.stat().st_size
                                 for path in out.glob("*.tfrecord")}
    cut = out / "train-00001-of-00002.tfrecord"
    cut.write_bytes(cut.read_bytes()[:int(cut.stat().st_size * 0.6)])
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "hvdtrain.cnn", "--tfrecords", str(out),
                             "--image-size", "16", "--epochs", "1", "--run-dir", str(run_dir)],
                            capture_output=True, text=True, timeout=RUN_TIMEOUT,
                            env=clean_env())
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"hvdtrain.cnn: error: TFRecord shard {cut} is "), lines
    assert "as dataset.json records: cut short or changed" in lines[0], lines
    assert not run_dir.exists()


def test_a_shard_cut_short_without_a_recorded_size_is_named_at_its_first_pass(images,
                                                                               tmp_path):
    """Shards whose sizes dataset.json does not hold (an older conversion; counts written by
    hand): the cut one's missing records were blanks "that did not decode", whatever
    --on-bad-image said. Now the pass that reaches its end names it, and the epoch's report
    stops every rank with that line (before the epoch's checkpoint)."""
    from hvdtrain.training.callbacks import DecodeFailureReport
    from hvdtrain.data.pipeline import build_pipelines
    from hvdtrain.data.records import list_tfrecords
    from hvdtrain.runtime.base import Devices, Runtime, World

    out = tmp_path / "shards"
    convert(str(images), str(out), shards=2, validation_shards=1, validation_fraction=0.2,
            seed=3, image_size=16, workers=1)
    metadata = json.loads((out / "dataset.json").read_text())
    del metadata["bytes"]
    (out / "dataset.json").write_text(json.dumps(metadata))
    cut = out / "train-00001-of-00002.tfrecord"
    recorded = metadata["counts"][cut.name]
    cut.write_bytes(cut.read_bytes()[:int(cut.stat().st_size * 0.6)])
    for sharding in ("file", "example"):
        listing = list_tfrecords(str(out), image_size=16)
        pipelines = build_pipelines(listing, World(rank=0, size=1), batch_size=4,
                                    validation_batch_size=4, seed=0,
                                    tfrecord_sharding=sharding)
        planned = listing.train.num_samples
        assert sum(1 for _ in pipelines.train.unbatch().take(planned)) == planned
        training = pipelines.decode_failures[0]
        found = re.fullmatch(rf"{re.escape(str(cut))} holds (\d+) records, not {recorded}",
                             training.miscounted_file() or "")
        assert found and int(found[1]) < recorded, (sharding, training.miscounted_file())
        report = DecodeFailureReport(Runtime(World(), Devices("cpu", "test")),
                                     pipelines.decode_failures, on_bad_image="skip")
        with pytest.raises(UserError, match=rf"^TFRecord shard {re.escape(str(cut))} holds "):
            report.on_epoch_end(0, {})
    # Whole shards are not named: the validation shard, read to its end, is right.
    listing = list_tfrecords(str(out), image_size=16)
    pipelines = build_pipelines(listing, World(rank=0, size=1), batch_size=4,
                                validation_batch_size=4, seed=0)
    assert sum(len(batch[1]) for batch in pipelines.validation) == \
        listing.validation.num_samples
    assert pipelines.decode_failures[1].miscounted_file() is None


def test_the_converters_edges_are_one_line_each_and_write_nothing(images, tmp_path,
                                                                   monkeypatch):
    """Each of these ran the whole conversion into a traceback, or wrote a wrong output with
    exit 0: --out a link (to an empty folder, or dangling), the directory it runs in, a folder
    inside the data; a class folder that links to another class (its images under two labels);
    a class none of whose files is an image (a class of 0 records). Links that lead nowhere (a
    loop, a missing target) are skipped and counted, by the converter and training alike."""
    from hvdtrain.data.folder import list_image_folder

    common = dict(shards=2, validation_shards=1, validation_fraction=0.2, seed=0, image_size=8,
                  workers=1)
    folder = tmp_path / "images"
    for path in images.glob("*/*"):
        (folder / path.parent.name).mkdir(parents=True, exist_ok=True)
        os.link(path, folder / path.parent.name / path.name)
    before = sorted(tmp_path.rglob("*"))

    def refused(out, message: str) -> None:
        with pytest.raises(UserError, match=f"^{re.escape(message)}"):
            convert(str(folder), str(out), **common)
        assert sorted(tmp_path.rglob("*")) == before, "a refused convert wrote something"

    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = sorted(tmp_path.rglob("*"))
    for link in ("to-empty", "dangling"):
        refused(tmp_path / link, f"--out {tmp_path / link} is a link; name a new directory")
    monkeypatch.chdir(tmp_path / "empty")
    for here in (".", ".."):
        refused(here, f"--out {here} is the directory this runs in, or holds it")
    monkeypatch.chdir(tmp_path)
    refused(folder / "shards", f"--out {folder / 'shards'} is inside --data-dir {folder}")

    # A class folder linked to another: one line, from the listing both commands share.
    (folder / "zzz").symlink_to(folder / "one")
    before = sorted(tmp_path.rglob("*"))
    same = f"class folders one and zzz in {folder} are the same folder ({folder / 'one'})"
    refused(tmp_path / "linked", same)
    with pytest.raises(UserError, match=f"^{re.escape(same)}"):
        list_image_folder(str(folder), image_size=8, validation_fraction=0.2, seed=0,
                          on_bad_image="skip")
    (folder / "zzz").unlink()

    # A class whose files all carry an image's name and none is one: no output, one line.
    (folder / "junk").mkdir()
    for index in range(3):
        (folder / "junk" / f"{index}.png").write_text("no image")
    before = sorted(tmp_path.rglob("*"))
    refused(tmp_path / "junk-out", f"no file of class folder {folder / 'junk'} is a readable "
                                   "PNG/JPEG/GIF/BMP image; fix or remove its files")
    shutil.rmtree(folder / "junk")

    # A link to itself and a dangling link: skipped, counted and named, in both.
    (folder / "one" / "loop.png").symlink_to("loop.png")
    (folder / "two" / "gone.png").symlink_to(tmp_path / "gone.png")
    note = (f"skipped 2 link(s) in {folder} lead to no file (a loop or a missing target; "
            f"first: {folder / 'one' / 'loop.png'})")
    metadata = convert(str(folder), str(tmp_path / "out"), **common)
    assert sum(metadata["counts"].values()) == 120 and metadata["skipped"] == [note]
    listing = list_image_folder(str(folder), image_size=8, validation_fraction=0.2, seed=0,
                                on_bad_image="skip")
    assert listing.notes == (note,)
    with pytest.raises(UserError, match="lead to no file .*; remove them or pass --on-bad-image "
                                        "skip$"):
        convert(str(folder), str(tmp_path / "failed"), on_bad_image="fail", **common)


def test_a_full_disk_is_one_line_and_the_rerun_resumes(images, tmp_path):
    """The disk fills while shards are written (a real tmpfs, too small): one line saying to rerun
    once there is room, then the same command with room finishes, keeping the complete shards."""
    from conftest import small_disk_at

    common = dict(shards=8, validation_shards=2, validation_fraction=0.2, seed=0, image_size=40,
                  workers=1)
    with small_disk_at(tmp_path / "disk", "48k") as disk:
        out = disk / "shards"
        with pytest.raises(UserError, match=rf"^cannot write {re.escape(staging_dir(str(out)))}"
                                            r"/\S+: .*No space left on device.*; rerun the same "
                                            r"command to resume once that is fixed$"):
            convert(str(images), str(out), **common)
        complete = set(os.listdir(Path(staging_dir(str(out))) / DONE_DIR))
        assert complete, "the small disk held no complete shard: make it larger"
        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        metadata = convert(str(images), str(out), **common)
        assert sum(metadata["counts"].values()) == 120
        assert sorted(os.listdir(out)) == sorted(["dataset.json", *metadata["counts"]])


def bytes_read_by_this_process() -> int:
    """What this process has read through read() so far (/proc/self/io's rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_huge_images_are_bounded_and_a_large_file_of_another_kind_is_never_read_whole(
        images, tmp_path):
    """A 20000 x 20000 PNG (400 KB, 400 M pixels): Pillow's bomb check dropped it as "not
    readable" even where it is kept as it is, and training decoded it whole (1.2 GB a decode).
    Now the converter keeps it where --max-resolution keeps it, skips it with its own note where
    resizing it would decode more than the limit, and training counts it as an image that does
    not decode, before decoding any of it. A 2 GiB file named .jpg that is no image is skipped
    after its first bytes, never read whole (it was: +2 GiB RSS)."""
    import tensorflow as tf
    from PIL import Image

    from hvdtrain.data.images import DECODED_PIXELS_LIMIT, decode_image

    folder = tmp_path / "images"
    for path in images.glob("*/*"):
        (folder / path.parent.name).mkdir(parents=True, exist_ok=True)
        os.link(path, folder / path.parent.name / path.name)
    huge = folder / "one" / "huge.png"
    Image.new("L", (20000, 20000)).save(huge)
    assert 20000 * 20000 > DECODED_PIXELS_LIMIT and huge.stat().st_size < 2 << 20
    large = folder / "two" / "large.jpg"
    with open(large, "wb") as file:
        file.truncate(2 << 30)  # sparse: no disk used
    common = dict(shards=2, validation_shards=1, validation_fraction=0.2, seed=0, image_size=8,
                  workers=1)
    read_before = bytes_read_by_this_process()
    metadata = convert(str(folder), str(tmp_path / "resized"), **common)
    assert bytes_read_by_this_process() - read_before < 100 << 20
    assert sum(metadata["counts"].values()) == 120
    assert metadata["skipped"] == [
        f"skipped 1 file(s) in {folder} that are not readable PNG/JPEG/GIF/BMP images (first: "
        f"{large})",
        f"skipped 1 file(s) in {folder} that decode to more pixels than the converter's limit "
        f"to be resized (first: {huge}; see --max-resolution)"]
    large.unlink()
    with pytest.raises(UserError, match=rf"^{re.escape(str(huge))} \(20000x20000\) decodes to "
                                        rf"more than {DECODED_PIXELS_LIMIT} pixels to be resized"):
        convert(str(folder), str(tmp_path / "failed"), on_bad_image="fail", **common)
    kept = convert(str(folder), str(tmp_path / "kept"), max_resolution=20000, **common)
    assert sum(kept["counts"].values()) == 121 and kept["skipped"] == []
    # Training's decode refuses it from its header (an error the pipeline counts), at once.
    started = time.monotonic()
    with pytest.raises(tf.errors.InvalidArgumentError, match="decoded pixels limit"):
        decode_image(tf.constant(huge.read_bytes()), (8, 8, 1))
    assert time.monotonic() - started < 5
