"""hvdtrain predict's arguments, its listings, its parts directory and the rows of damaged shards
(a tiny model's), in process. A trained run predicted on 1 and 2 ranks against Keras' own
predict, and a resume, are test_jobs.py's."""
from __future__ import annotations

import json
import os

import pytest

from hvdtrain import predict
from hvdtrain.errors import UserError
from hvdtrain.predict.inputs import InputFailure, list_file_list, list_folder
from hvdtrain.predict.parts import MANIFEST, Parts


@pytest.mark.parametrize("argv, message", [
    ([], "name the inputs once: --data-dir, --files or --tfrecords"),
    (["--data-dir", "a", "--files", "b"], "name the inputs once"),
    (["--data-dir", "a", "--checkpoint", "newest"], "--checkpoint must be 'latest' or"),
    (["--data-dir", "a", "--top-k", "0"], "--top-k must be at least 1"),
    (["--data-dir", "a", "--part-size", "0"], "--part-size must be at least 1"),
    (["--data-dir", "a", "--progress-seconds", "-1"], "--progress-seconds must be >= 0"),
    (["--data-dir", "a", "--output", "rows.xlsx"], "name a .csv, .jsonl or .parquet file"),
    # URLs are refused, never taken for relative paths (./gs:/b/rows.csv).
    (["--tfrecords", "gs://b/shards"], "--tfrecords gs://b/shards: this command takes file "
                                       "system paths, not URLs: copy it to a file system"),
    (["--data-dir", "a", "--output", "gs://b/rows.csv"], "--output gs://b/rows.csv: this "
                                                         "command takes file system paths"),
    (["--data-dir", "a", "--run-dir", "s3://b/run"], "--run-dir s3://b/run: this command"),
])
def test_bad_arguments_are_one_line_before_anything_is_read(argv, message):
    argv = argv if any(arg == "--output" for arg in argv) else [*argv, "--output", "rows.csv"]
    with pytest.raises(UserError, match=message):
        predict.parse(["--run-dir", "runs/x", *argv])


def test_a_folder_is_listed_at_any_depth_in_path_order(tmp_path):
    for name in ("b/2.png", "a/deeper/1.JPG", "a/0.gif", "c.bmp", "notes.txt", "a/x.jpeg"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "loop").symlink_to(tmp_path)  # a link to a folder is not followed
    (tmp_path / "gone.png").symlink_to(tmp_path / "nowhere.png")  # an input that fails
    (tmp_path / "self.png").symlink_to(tmp_path / "self.png")  # ELOOP: the same
    os.mkfifo(tmp_path / "pipe.png")  # never opened: its read would wait forever
    (tmp_path / os.fsdecode(b"caf\xe9.png")).write_bytes(b"")  # not UTF-8: a row all the same
    inputs = list_folder(str(tmp_path))
    keys = [inputs.key(index) for index in range(len(inputs))]
    assert keys == [str(tmp_path / name) for name in (
        "a/0.gif", "a/deeper/1.JPG", "a/x.jpeg", "b/2.png", "c.bmp", "caf\\xe9.png",
        "gone.png", "self.png")]
    assert inputs.notes == ("left out 1 file(s) without an image's extension (.bmp, .gif, "
                            ".jpeg, .jpg, .png)", "did not follow 1 link(s) to folders",
                            "left out 1 named like images that are not files (a FIFO, a "
                            "socket, a device)")
    with pytest.raises(InputFailure, match="^cannot read: No such file or directory$"):
        inputs.read_alone(6)
    with pytest.raises(InputFailure, match="^cannot read: Too many levels of symbolic links$"):
        inputs.read_alone(7)
    assert inputs.path(5) == os.fsencode(tmp_path) + b"/caf\xe9.png"
    # What travels to the other ranks is the same listing.
    import pickle

    again = pickle.loads(pickle.dumps(inputs))
    assert [again.key(index) for index in range(len(again))] == keys
    assert again.digest() == inputs.digest()
    (tmp_path / "b" / "empty").mkdir()
    with pytest.raises(UserError, match="holds no PNG/JPEG/GIF/BMP files"):
        list_folder(str(tmp_path / "b" / "empty"))
    with pytest.raises(UserError, match="no such directory"):
        list_folder(str(tmp_path / "nothing"))


def test_a_records_key_names_its_shard_apart_from_a_shard_of_the_same_name_elsewhere():
    """Shards of one folder are keyed by their names; a glob reaching two folders (two
    converted sets, each with its val-00000-of-00001.tfrecord) by their paths below the folder
    holding both, so no two rows share a key."""
    import numpy as np

    from hvdtrain.predict.records import RecordInputs

    def keys(*files):
        inputs = RecordInputs(description="", notes=(), files=files,
                              counts=np.array([2] * len(files)))
        return [inputs.key(index) for index in range(len(inputs))]

    assert keys("/d/a/val-0.tfrecord", "/d/a/val-1.tfrecord") == [
        "val-0.tfrecord:0", "val-0.tfrecord:1", "val-1.tfrecord:0", "val-1.tfrecord:1"]
    assert keys("/d/a/val-0.tfrecord", "/d/b/c/val-0.tfrecord") == [
        "a/val-0.tfrecord:0", "a/val-0.tfrecord:1", "b/c/val-0.tfrecord:0",
        "b/c/val-0.tfrecord:1"]


def test_a_list_keeps_its_order_and_reads_relative_paths_from_its_folder(tmp_path):
    (tmp_path / "list.txt").write_text("# new photos\nb.png\n\n/abs/a.png\nb.png\r\n")
    inputs = list_file_list(str(tmp_path / "list.txt"))
    assert [inputs.key(index) for index in range(len(inputs))] == ["b.png", "/abs/a.png",
                                                                    "b.png"]
    assert [inputs.path(index) for index in range(3)] == [
        os.fsencode(tmp_path / "b.png"), b"/abs/a.png", os.fsencode(tmp_path / "b.png")]
    # A list's names are checked as they are read: what is not a regular file is never opened.
    os.mkfifo(tmp_path / "b.png")
    assert not inputs.listed_as_files and not inputs._is_regular(0)
    with pytest.raises(InputFailure, match="^not a regular file$"):
        inputs.read_alone(0)
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(UserError, match="names no file"):
        list_file_list(str(tmp_path / "empty.txt"))


def test_parts_resume_only_their_own_prediction(tmp_path):
    output = str(tmp_path / "rows.csv")
    identity = {"inputs": "abc", "count": 25, "part_size": 10}
    parts = Parts(output, count=25, part_size=10)
    assert parts.num_parts == 3 and parts.bounds(2) == (20, 25)
    assert parts.prepare(identity) == []
    parts.write(1, [[{"input": "x", "error": None}]])
    # A rank killed while writing part 0 leaves the file it was writing beside the name.
    (tmp_path / "rows.csv.parts" / ".part-000000.jsonl.k2j4x9.jsonl").write_text('{"input"')
    parts.release()  # the job ended
    again = Parts(output, count=25, part_size=10)
    assert again.prepare(identity) == [1]
    assert sorted(os.listdir(again.directory)) == ["part-000001.jsonl", MANIFEST]
    again.release()
    with pytest.raises(UserError, match=r"holds the parts of another prediction \(inputs "
                                        r"differ\): remove it"):
        Parts(output, count=25, part_size=10).prepare({**identity, "inputs": "other"})
    parts = Parts(output, count=25, part_size=10)
    parts.prepare(identity)
    assert json.loads((tmp_path / "rows.csv.parts" / MANIFEST).read_text()) == identity

    assert oct(os.stat(parts.directory).st_mode & 0o777) == "0o700"
    # Another predict into the same output while this one holds it.
    with pytest.raises(UserError, match="another hvdtrain predict is writing"):
        Parts(output, count=25, part_size=10).prepare(identity)
    parts.remove()
    assert not os.path.exists(parts.directory)

    # Made by someone else, a link, or open to others (who could put a part in): never used.
    planted = Parts(str(tmp_path / "other.csv"), count=25, part_size=10)
    os.symlink(tmp_path, planted.directory)
    with pytest.raises(UserError, match="is not a directory of yours that predict made"):
        planted.prepare(identity)
    opened = Parts(str(tmp_path / "open.csv"), count=25, part_size=10)
    os.mkdir(opened.directory, 0o777)
    os.chmod(opened.directory, 0o777)
    with pytest.raises(UserError, match="open to others"):
        opened.prepare(identity)


def test_the_merge_writes_every_part_in_order_and_counts_the_failed_rows(tmp_path):
    from hvdtrain.predict.formats import open_writer

    parts = Parts(str(tmp_path / "rows.jsonl"), count=5, part_size=2)
    parts.prepare({"inputs": "abc"})
    for part, rows in ((2, [["e"]]), (0, [["a"], ["b"]]), (1, [["c", "d"]])):
        parts.write(part, ([{"input": key, "error": "gone" if key == "d" else None}
                            for key in block] for block in rows))
    parts.wait_for_all(say=print, every_seconds=0)  # all there: returns at once
    writer = open_writer(str(tmp_path / "rows.jsonl"), ".jsonl", ["input", "error"])
    assert parts.merge(writer) == (5, 1)
    writer.close()
    assert [json.loads(line)["input"] for line in
            (tmp_path / "rows.jsonl").read_text().splitlines()] == ["a", "b", "c", "d", "e"]


def test_a_run_of_another_job_needs_raw_and_one_without_a_model_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"program": "hvdtrain.autoencoder",
                                                     "config": {}}))
    request = predict.parse(["--run-dir", str(run_dir), "--data-dir", "x", "--output",
                             str(tmp_path / "rows.csv")])
    with pytest.raises(UserError, match="is a run of hvdtrain.autoencoder, not of the "
                                        "classifier: pass --raw"):
        predict.run(request)
    raw = predict.parse(["--run-dir", str(run_dir), "--data-dir", "x", "--raw", "--output",
                         str(tmp_path / "rows.csv")])
    with pytest.raises(UserError, match="holds no model.keras"):
        predict.run(raw)
    assert sorted(os.listdir(tmp_path)) == ["run"]


@pytest.mark.parametrize("augment", [False, True])
def test_a_corrupt_record_is_the_only_row_it_costs_whatever_the_part_size(tmp_path, augment):
    """A byte flipped in one record's image (its data's CRC fails, its framing holds) ends the
    TFRecordDataset reading its run of records: the records it dropped are read again alone, so
    its row alone says so and every other record's prediction is the clean shards' (issue 62:
    a corrupt file is a row that says so; each input once, as one process predicts it). A
    shard cut short that its dataset.json still counts: the missing record's row says so; one
    whose record's length is damaged: that record's row and those after it (no header past it
    can be found) say so."""
    import keras
    import tensorflow as tf

    from hvdtrain.cnn import ClassifierConfig
    from hvdtrain.data.records import METADATA, serialize_example
    from hvdtrain.predict import Predictor, Progress
    from hvdtrain.predict.records import list_records
    from images import make_image_folder

    images = sorted(path for path in make_image_folder(tmp_path / "images", classes=2,
                                                        per_class=6).rglob("*.*"))
    clean, damaged = tmp_path / "clean", tmp_path / "damaged"
    for folder in (clean, damaged):
        folder.mkdir()
        for shard, paths in enumerate((images[:4], images[4:8], images[8:])):
            with tf.io.TFRecordWriter(str(folder / f"train-{shard}.tfrecord")) as writer:
                for path in paths:
                    writer.write(serialize_example(path.read_bytes(), 0))
        names = [path.name for path in sorted(folder.glob("*.tfrecord"))]
        (folder / METADATA).write_text(json.dumps({  # as the converter counts them
            "counts": dict.fromkeys(names, 4),
            "bytes": {name: os.path.getsize(folder / name) for name in names}}))
    corrupt = damaged / "train-0.tfrecord"
    data = bytearray(corrupt.read_bytes())
    flipped = data.index(images[2].read_bytes()) + 100  # inside record 2's image
    data[flipped] ^= 0xFF
    corrupt.write_bytes(data)
    cut = damaged / "train-1.tfrecord"
    cut.write_bytes(cut.read_bytes()[:-10])  # its last record's end is lost
    lengths = damaged / "train-2.tfrecord"
    data = bytearray(lengths.read_bytes())
    header = 0
    for _ in range(2):  # record 2's header: past two records' framing and data
        header += 16 + int.from_bytes(data[header:header + 8], "little")
    data[header] ^= 0x01  # its length, off by one
    lengths.write_bytes(data)

    inputs = keras.Input((8, 8, 3), dtype="uint8")
    model = keras.Model(inputs, keras.layers.Dense(3)(
        keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(inputs))))
    config = ClassifierConfig(tfrecords=str(clean), image_size=8, channels=3, augment=augment)
    predictor = Predictor(model, (8, 8, 3), config, classes=None, top_k=0, batch_size=4,
                          threads=None)

    def rows(folder, ranges):
        listed = list_records(str(folder))
        # No runtime: a Progress of 0 seconds never prints.
        stream = predictor.stream(listed, ranges, Progress(None, 12, 12, seconds=0))
        return [row for _, block, _ in stream for row in block]

    expected = rows(clean, [(0, 12)])
    assert all(row["error"] is None for row in expected)
    for ranges in ([(0, 12)], [(0, 5), (5, 10), (10, 12)]):  # one part, parts of 5
        got = rows(damaged, ranges)
        assert [row["input"] for row in got] == [row["input"] for row in expected]
        errors = {row["input"]: row["error"] for row in got if row["error"]}
        assert sorted(errors) == ["train-0.tfrecord:2", "train-1.tfrecord:3",
                                  "train-2.tfrecord:2", "train-2.tfrecord:3"], (ranges, errors)
        assert errors["train-0.tfrecord:2"].startswith(
            f"record 2 of {corrupt} cannot be read: corrupted record at ")
        assert errors["train-1.tfrecord:3"] == (f"record 3 of {cut} cannot be read: the file ends "
                                                "before the record does (cut short)")
        for record in (2, 3):
            assert errors[f"train-2.tfrecord:{record}"] == (
                f"record {record} of {lengths} cannot be read: the length of record 2 is "
                "damaged, so no record from it on can be found")
        for row, clean_row in zip(got, expected):
            if not row["error"]:
                assert row["output"] == pytest.approx(clean_row["output"], abs=1e-6), row
