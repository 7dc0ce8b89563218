"""hvdtrain predict's arguments, its listings and its parts directory, in process. A trained run
predicted on 1 and 2 ranks against Keras' own predict, and a resume, are test_jobs.py's."""
from __future__ import annotations

import json
import os

import pytest

from hvdtrain import predict
from hvdtrain.errors import UserError
from hvdtrain.predict.inputs import list_file_list, list_folder
from hvdtrain.predict.parts import MANIFEST, Parts


@pytest.mark.parametrize("argv, message", [
    ([], "name the inputs once: --data-dir, --files or --tfrecords"),
    (["--data-dir", "a", "--files", "b"], "name the inputs once"),
    (["--data-dir", "a", "--checkpoint", "newest"], "--checkpoint must be 'latest' or"),
    (["--data-dir", "a", "--top-k", "0"], "--top-k must be at least 1"),
    (["--data-dir", "a", "--part-size", "0"], "--part-size must be at least 1"),
    (["--data-dir", "a", "--progress-seconds", "-1"], "--progress-seconds must be >= 0"),
    (["--data-dir", "a", "--output", "rows.xlsx"], "name a .csv, .jsonl or .parquet file"),
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
    inputs = list_folder(str(tmp_path))
    keys = [inputs.key(index) for index in range(len(inputs))]
    assert keys == [str(tmp_path / name) for name in ("a/0.gif", "a/deeper/1.JPG", "a/x.jpeg",
                                                      "b/2.png", "c.bmp", "gone.png")]
    assert inputs.notes == ("left out 1 file(s) without an image's extension (.bmp, .gif, "
                            ".jpeg, .jpg, .png)", "did not follow 1 link(s) to folders")
    assert inputs.failure(5, decode=None).startswith("cannot read: No such file")
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


def test_a_list_keeps_its_order_and_reads_relative_paths_from_its_folder(tmp_path):
    (tmp_path / "list.txt").write_text("# new photos\nb.png\n\n/abs/a.png\nb.png\r\n")
    inputs = list_file_list(str(tmp_path / "list.txt"))
    assert [inputs.key(index) for index in range(len(inputs))] == ["b.png", "/abs/a.png",
                                                                    "b.png"]
    assert [inputs.path(index) for index in range(3)] == [
        os.fsencode(tmp_path / "b.png"), b"/abs/a.png", os.fsencode(tmp_path / "b.png")]
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(UserError, match="names no file"):
        list_file_list(str(tmp_path / "empty.txt"))


def test_parts_resume_only_their_own_prediction(tmp_path):
    output = str(tmp_path / "rows.csv")
    identity = {"inputs": "abc", "count": 25, "part_size": 10}
    parts = Parts(output, count=25, part_size=10)
    assert parts.num_parts == 3 and parts.bounds(2) == (20, 25)
    assert parts.prepare(identity) == []
    finished = parts.writing(1)
    finished.write([{"input": "x", "error": None}])
    finished.finish()
    stopped = parts.writing(0)  # a rank killed while writing it
    stopped.write([{"input": "y", "error": None}])
    assert parts.prepare(identity) == [1]
    assert sorted(os.listdir(parts.directory)) == ["part-000001.jsonl", MANIFEST]
    with pytest.raises(UserError, match=r"holds the parts of another prediction \(inputs "
                                        r"differ\): remove it"):
        parts.prepare({**identity, "inputs": "other"})
    assert json.loads((tmp_path / "rows.csv.parts" / MANIFEST).read_text()) == identity

    # Made by someone else, or a link: never used.
    planted = Parts(str(tmp_path / "other.csv"), count=25, part_size=10)
    os.symlink(tmp_path, planted.directory)
    with pytest.raises(UserError, match="is not a directory of yours that predict made"):
        planted.prepare(identity)


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
