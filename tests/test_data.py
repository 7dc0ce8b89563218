"""Listing, splitting and sharding the data, with every rank simulated in one process."""
from __future__ import annotations

import json
import os
import pickle
import re
import socket
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.training.config import CacheSetting, ImageConfig
from hvdtrain.data import build_pipelines, list_data, split_indices
from hvdtrain.data.folder import list_image_folder
from hvdtrain.data.records import file_order, files_for_rank, list_tfrecords
from hvdtrain.errors import RankError, UserError
from hvdtrain.runtime import World
from hvdtrain.tfrecords import convert
from images import make_image_folder


def ids_of(dataset) -> list[int]:
    return [int(source) for source, _ in dataset.as_numpy_iterator()]


def test_digits_are_real_embedded_data():
    listing = list_data(ImageConfig())
    assert listing.image_shape == (8, 8, 1)
    assert len(listing.class_names) == 10
    assert listing.train.num_samples + listing.validation.num_samples == 1797
    assert listing.images.dtype == np.uint8 and listing.images.max() == 255
    # Read from scikit-learn's file without importing it: what load_digits gives, exactly.
    from sklearn.datasets import load_digits

    from hvdtrain.data.embedded import load_embedded

    digits, embedded = load_digits(), load_embedded("digits")
    assert np.array_equal(embedded.labels, digits.target)
    assert np.array_equal(embedded.images[..., 0],
                          (digits.images * (255.0 / 16.0)).round().astype(np.uint8))


def test_split_is_deterministic_disjoint_and_complete():
    train, validation = split_indices(1000, 0.2, seed=7)
    again_train, _ = split_indices(1000, 0.2, seed=7)
    assert np.array_equal(train, again_train)
    assert len(validation) == 200
    assert sorted(np.concatenate([train, validation])) == list(range(1000))
    assert not np.array_equal(train, split_indices(1000, 0.2, seed=8)[0])


def test_files_are_split_by_name_so_a_removed_file_moves_no_other_across():
    """Files were split by their place in the sorted list: deleting one (a file that did not
    decode) reshuffled the rest, and a resume validated on files it had trained on. Now each
    file's side comes from its name and the seed alone."""
    from hvdtrain.data.listing import FileTable, held_out_by_name, name_hashes, split_by_mask

    names = [f"class{i % 3}/{i:05d}.jpg".encode() for i in range(1000)]
    labels = np.array([i % 3 for i in range(1000)], dtype=np.int64)

    def sides(kept: list[int], seed: int = 7) -> tuple[set, set]:
        held_out = held_out_by_name(name_hashes([names[i] for i in kept]), 0.2, seed)
        train, validation = split_by_mask(held_out, seed)
        return {kept[i] for i in train}, {kept[i] for i in validation}

    train, validation = sides(list(range(1000)))
    assert train.isdisjoint(validation) and len(train | validation) == 1000
    assert 150 <= len(validation) <= 250  # 0.2 on average: 200 +- 13
    removed = {3, 500, min(validation)}
    kept_train, kept_validation = sides([i for i in range(1000) if i not in removed])
    assert (kept_train, kept_validation) == (train - removed, validation - removed)
    assert sides(list(range(1000)), seed=8) != (train, validation)
    # At least one file on each side, however few.
    assert [len(side) for side in sides([0, 1])] == [1, 1]

    sized = {names[0].decode(): 10, names[1].decode(): 11}
    table = FileTable.of(name_hashes(names), labels, sized)
    stored = FileTable.from_bytes(table.to_bytes())
    assert np.array_equal(stored.rows, table.rows) and stored.sized == sized
    kept = [i for i in range(1000) if i not in removed]
    fewer = FileTable.of(name_hashes([names[i] for i in kept]), labels[kept], sized)
    assert fewer.files_removed_since(table) == 3
    assert table.files_removed_since(fewer) is None  # files added
    relabelled = labels.copy()
    relabelled[10] = 2 if relabelled[10] != 2 else 0
    assert FileTable.of(name_hashes(names), relabelled, sized).files_removed_since(table) is None
    resized = FileTable.of(name_hashes(names[1:]), labels[1:], {names[1].decode(): 12})
    assert resized.files_removed_since(table) is None  # a weighed file of another size


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shards_are_disjoint_and_cover_the_split(size):
    listing = list_data(ImageConfig())
    shards = [ids_of(listing.shard_records(listing.train, World(rank=r, size=size), seed=0,
                                   by_file=False)) for r in range(size)]
    flat = [i for shard in shards for i in shard]
    assert len(flat) == len(set(flat)), "a sample is in two shards"
    assert sorted(flat) == sorted(listing.train.sources.tolist())
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@pytest.mark.parametrize("samples", [7, 10, 13, 29])
@pytest.mark.parametrize("size", [2, 3])
def test_uneven_shards_still_give_every_rank_the_planned_steps(samples, size):
    config = ImageConfig(data="synthetic", synthetic_samples=samples, validation_fraction=0.0)
    listing = list_data(config)
    batch = 2
    steps = samples // (batch * size)
    for rank in range(size):
        pipelines = build_pipelines(listing, World(rank=rank, size=size),
                                    batch_size=batch, validation_batch_size=0, seed=0)
        # Two epochs' worth: the training stream repeats, so no rank can run dry.
        batches = list(pipelines.train.take(2 * steps).as_numpy_iterator())
        assert len(batches) == 2 * steps
        assert all(images.shape == (batch, 8, 8, 1) for images, _ in batches)


def test_image_folder_png_and_jpeg_of_any_size(tmp_path):
    root = make_image_folder(tmp_path / "images", classes=3, per_class=12)
    listing = list_image_folder(str(root), image_size=16, validation_fraction=0.25, seed=0,
                                on_bad_image="skip")
    assert listing.class_names == ("one", "two", "zero")
    assert listing.train.num_samples + listing.validation.num_samples == 36
    pipelines = build_pipelines(listing, World(), batch_size=4,
                                validation_batch_size=4, seed=0)
    images, labels, weights = next(iter(pipelines.train))
    assert images.shape == (4, 16, 16, 3) and images.dtype.name == "uint8"
    assert set(labels.numpy()) <= {0, 1, 2}
    assert weights.numpy().tolist() == [1.0] * 4  # every file decoded
    assert len(list(pipelines.validation)) == 2


@pytest.mark.parametrize("channels", [1, 3])
def test_every_format_decodes_to_gray_or_colour_with_or_without_augmentation(tmp_path, channels):
    """PNG (gray, RGBA), JPEG, GIF and BMP, at --channels 1 and 3: TensorFlow decodes GIF and BMP
    only to colour, so at 1 channel hvdtrain converts them (they were blanks of weight 0)."""
    from PIL import Image

    from hvdtrain.data.cache import CacheChoice

    gray = 128  # every picture is this gray, in whatever mode its format stores it
    pictures = {"png": Image.new("L", (20, 14), gray), "rgba.png": Image.new("RGBA", (20, 14),
                (gray, gray, gray, 255)), "jpg": Image.new("RGB", (20, 14), (gray,) * 3),
                "gif": Image.new("RGB", (20, 14), (gray,) * 3),
                "bmp": Image.new("RGB", (20, 14), (gray,) * 3)}
    for label in ("a", "b"):
        (tmp_path / "data" / label).mkdir(parents=True)
        for name, picture in pictures.items():
            picture.save(tmp_path / "data" / label / f"x.{name}")
    listing = list_image_folder(str(tmp_path / "data"), image_size=8, validation_fraction=0.0,
                                seed=0, on_bad_image="fail", channels=channels)
    assert listing.train.num_samples == 10
    for augment, cache in ((False, "memory"), (True, "off"), (True, "memory")):
        pipelines = build_pipelines(listing, World(), batch_size=10, validation_batch_size=0,
                                    seed=0, augment=augment,
                                    cache=CacheChoice(cache, "test", str(tmp_path)))
        images, _, weights = next(iter(pipelines.train))
        assert images.shape == (10, 8, 8, channels), (augment, cache)
        assert weights.numpy().tolist() == [1.0] * 10, (augment, cache)
        assert np.abs(images.numpy().astype(int) - gray).max() <= 2, (augment, cache)
        assert pipelines.decode_failures[0].take_new() == (0, None)


@pytest.mark.parametrize("make_bad, message", [
    (lambda root: None, "no such directory"),
    (lambda root: root.mkdir(), "no class sub-folders"),
    (lambda root: make_image_folder(root, classes=1, per_class=3), "only one class folder"),
    (lambda root: (make_image_folder(root, classes=2, per_class=3), (root / "empty").mkdir()),
     "has no PNG/JPEG/GIF/BMP images"),
])
def test_unusable_folders_are_one_line_errors(tmp_path, make_bad, message):
    root = tmp_path / "data"
    make_bad(root)
    with pytest.raises(UserError, match=message) as error:
        list_image_folder(str(root), image_size=None, validation_fraction=0.2, seed=0,
                          on_bad_image="skip")
    assert "\n" not in str(error.value)


def _write_raw_name(directory: Path, raw_name: bytes, data: bytes = b"") -> bool:
    """A file or folder whose name is raw bytes; False where the file system refuses them."""
    try:
        path = os.path.join(os.fsencode(directory), raw_name)
        if data is None:
            os.mkdir(path)
        else:
            with open(path, "wb") as output:
                output.write(data)
    except OSError:
        return False
    return True


def test_file_names_that_are_not_utf8_are_skipped_and_counted_or_refused(tmp_path):
    root = make_image_folder(tmp_path / "images", classes=2, per_class=4)
    some_png = next(root.glob("*/*.png")).read_bytes()
    if not _write_raw_name(root / "zero", b"bad-\xff.png", some_png):
        pytest.skip("this file system refuses names that are not UTF-8")
    listing = list_image_folder(str(root), image_size=8, validation_fraction=0.25, seed=0,
                                on_bad_image="skip")
    assert listing.train.num_samples + listing.validation.num_samples == 8  # well named
    assert any("1 file(s)" in note and "not valid UTF-8" in note and "\\xff" in note
               for note in listing.notes), listing.notes
    with pytest.raises(UserError, match=r"not valid UTF-8 .*--on-bad-image skip") as refused:
        list_image_folder(str(root), image_size=8, validation_fraction=0.25, seed=0,
                          on_bad_image="fail")
    assert "\n" not in str(refused.value)


def test_a_class_folder_that_is_not_utf8_is_one_line(tmp_path):
    root = make_image_folder(tmp_path / "images", classes=2, per_class=4)
    if not _write_raw_name(root, b"class-\xfe", None):
        pytest.skip("this file system refuses names that are not UTF-8")
    with pytest.raises(UserError, match=r"class folder .*xfe.* is not a valid UTF-8 name"):
        list_image_folder(str(root), image_size=8, validation_fraction=0.25, seed=0,
                          on_bad_image="skip")


@pytest.mark.integration
def test_a_class_folder_that_cannot_be_listed_is_one_line(tmp_path):
    """A class folder this user may not read, for training and the converter. Root reads any
    folder, so the commands run as root of a user namespace: the folder's owner is not mapped
    there, so no capability overrides its mode."""
    import subprocess
    import sys

    if subprocess.run(["unshare", "--user", "--map-root-user", "true"]).returncode != 0:
        pytest.skip("no user namespaces here (unshare --user)")
    root = make_image_folder(tmp_path / "data", classes=2, per_class=3)
    locked = root / "one"
    os.chown(locked, 12345, 12345)
    locked.chmod(0o700)
    for module, out in (("hvdtrain.tfrecords", "--out"), ("hvdtrain.cnn", "--run-dir")):
        result = subprocess.run(
            ["unshare", "--user", "--map-root-user", sys.executable, "-m", module, "--data-dir",
             str(root), out, str(tmp_path / module)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.strip() == f"{module}: error: cannot list {locked}: Permission denied"
        assert not list(tmp_path.glob(module + "*"))


def test_listing_opens_only_files_without_an_image_extension(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, per_class=5)
    (root / "zero" / "notes.txt").write_text("not an image")
    (root / "zero" / "scan.dat").write_bytes((root / "zero" / "000.png").read_bytes())
    (root / "one" / "broken.png").write_bytes(b"garbage that is not a PNG")
    listing = list_image_folder(str(root), image_size=None, validation_fraction=0.2, seed=0,
                                on_bad_image="skip")
    # The two odd extensions were opened: the text file is skipped, the PNG named .dat kept;
    # broken.png has an image's name, so it is listed and left to the decoder to skip and count.
    assert "2 header(s) checked" in listing.description
    listed = {listing.path(source) for split in (listing.train, listing.validation)
              for source in split.sources}
    assert len(listed) == 12
    assert str(root / "one" / "broken.png") in listed and str(root / "zero" / "scan.dat") in listed
    assert listing.notes and "skipped 1 file(s)" in listing.notes[0] and "notes.txt" in listing.notes[0]
    with pytest.raises(UserError, match="1 file.*--on-bad-image skip"):
        list_image_folder(str(root), image_size=None, validation_fraction=0.2, seed=0,
                          on_bad_image="fail")
    # --check-images opens every file: broken.png is found while listing too.
    checked = list_image_folder(str(root), image_size=None, validation_fraction=0.2, seed=0,
                                on_bad_image="skip", check_images=True)
    assert "13 header(s) checked" in checked.description
    assert checked.train.num_samples + checked.validation.num_samples == 11
    assert "skipped 2 file(s)" in checked.notes[0]


def test_the_listing_travels_as_a_compact_table_and_every_rank_redoes_the_split(tmp_path):
    root = tmp_path / "data"
    source = make_image_folder(tmp_path / "source", classes=2, per_class=1)
    for class_name in ("zero", "one", "two"):
        (root / class_name).mkdir(parents=True)
        for index in range(3000):  # hard links: a big folder in milliseconds
            os.link(source / "zero" / "000.png", root / class_name / f"img-{index:05d}.png")
    listing = list_image_folder(str(root), image_size=None, validation_fraction=0.1, seed=7,
                                on_bad_image="skip")
    packed = pickle.dumps(listing)
    received = pickle.loads(packed)
    for mine, theirs in ((listing.train, received.train), (listing.validation, received.validation)):
        assert (mine.sources == theirs.sources).all() and (mine.labels == theirs.labels).all()
    plain = pickle.dumps([listing.train.sources, listing.validation.sources,
                          listing.train.labels, listing.validation.labels])
    assert len(packed) * 5 < len(plain), (len(packed), len(plain))


def add_undecodable_files(root, per_class: int) -> list[str]:
    """Files whose headers pass the listing's check but whose bodies do not decode."""
    bad = []
    for class_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        jpeg = next(class_dir.glob("*.jpg")).read_bytes()
        png = next(class_dir.glob("*.png")).read_bytes()
        for index in range(per_class):
            path = class_dir / f"bad-{index}.{'jpg' if index % 2 else 'png'}"
            # A valid header, then a third of the body (a download cut short).
            source = jpeg if index % 2 else png
            path.write_bytes(source[:max(len(source) // 3, 40)])
            bad.append(str(path))
    return bad


@pytest.mark.parametrize("size", [1, 2, 3])
def test_undecodable_files_become_blank_samples_and_every_rank_keeps_its_count(tmp_path, size):
    root = make_image_folder(tmp_path / "data", classes=2, per_class=12)
    bad = add_undecodable_files(root, per_class=4)
    listing = list_image_folder(str(root), image_size=8, validation_fraction=0.25, seed=0,
                                on_bad_image="skip")
    assert listing.train.num_samples + listing.validation.num_samples == 32  # headers look fine
    batch = 2
    skipped, names, validated = 0, set(), 0
    for rank in range(size):
        world = World(rank=rank, size=size)
        pipelines = build_pipelines(listing, world, batch_size=batch,
                                    validation_batch_size=batch, seed=0)
        # One full pass over this rank's shard: exactly its planned number of samples, the
        # undecodable ones as weight-0 blanks, so no rank can run short of a batch.
        planned = len(listing.train.sources[rank::size])
        train = list(pipelines.train.unbatch().take(planned).as_numpy_iterator())
        validation = list(pipelines.validation.as_numpy_iterator())
        # Its whole share of the validation files, the last batch partial, as it says.
        share = len(listing.validation.sources[rank::size])
        assert pipelines.validation_samples == share
        assert [len(labels) for _, labels, _ in validation] == \
            [batch] * (share // batch) + [share % batch] * bool(share % batch)
        assert len(validation) == pipelines.validation.cardinality()
        validated += share
        weights = [w for _, _, w in train] + [w for batch_ in validation for w in batch_[2]]
        blanks = [image for image, _, w in train if w == 0]
        assert all(not image.any() for image in blanks)
        for counter in pipelines.decode_failures:
            count, name = counter.take_new()
            skipped += count
            names |= {name} if name else set()
            assert counter.take_new() == (0, None)  # counted once, not again
        assert weights.count(0.0) <= len(bad)
    # Every undecodable file is counted once, by the rank that owns it, and every validation
    # file is in one rank's share.
    assert validated == listing.validation.num_samples
    assert skipped == len(bad)
    assert names and names <= set(bad)


def test_tfrecords_round_trip_and_file_sharding(tmp_path):
    root = make_image_folder(tmp_path / "images", classes=3, per_class=10)
    metadata = convert(str(root), str(tmp_path / "records"), shards=3, validation_shards=1,
                       validation_fraction=0.2, seed=42, image_size=16)
    assert sum(metadata["counts"].values()) == 30
    assert json.loads((tmp_path / "records" / "dataset.json").read_text())["class_names"] == [
        "one", "two", "zero"]
    listing = list_tfrecords(str(tmp_path / "records"), image_size=None)
    assert listing.image_shape == (16, 16, 3)
    folder = list_image_folder(str(root), image_size=16, validation_fraction=0.2, seed=42,
                               on_bad_image="skip")  # the split the converter wrote
    assert (listing.train.num_samples, listing.validation.num_samples) == (
        folder.train.num_samples, folder.validation.num_samples)
    assert listing.train.num_samples + listing.validation.num_samples == 30
    # File sharding: 3 ranks, one whole shard each, all records read exactly once.
    seen = []
    for rank in range(3):
        records = listing.shard_records(listing.train, World(rank=rank, size=3), seed=0,
                                        by_file=True)
        seen.append(sum(1 for _ in records))
    assert sorted(seen) == sorted(listing.train.counts.tolist())
    assert sum(seen) == listing.train.num_samples
    pipelines = build_pipelines(listing, World(rank=1, size=3), batch_size=4,
                                validation_batch_size=2, seed=0)
    images, labels, weights = next(iter(pipelines.train))
    assert images.shape == (4, 16, 16, 3)


def test_shards_stored_smaller_than_training_decodes_to_warn_in_one_line(tmp_path):
    """--max-resolution 16 (files of 24-40 pixels): enough for --image-size 16, not for its
    --augment, which decodes to 18 (16 / 0.875) and crops from that."""
    root = make_image_folder(tmp_path / "images", classes=2, per_class=4)
    records = str(tmp_path / "records")
    convert(str(root), records, shards=1, validation_shards=1, validation_fraction=0.25, seed=0,
            image_size=16, max_resolution=16)
    assert list_data(ImageConfig(tfrecords=records, image_size=16)).notes == ()
    assert list_data(ImageConfig(tfrecords=records, image_size=16, augment=True)).notes == (
        f"warning: {records} stores images at a shorter side of at most 16 pixels, fewer than "
        "the 18 that --image-size 16 with --augment decodes to, so they are upsampled; convert "
        "with --image-size 16 for the full detail",)
    assert list_data(ImageConfig(tfrecords=records, image_size=12, augment=True)).notes == ()


@pytest.mark.parametrize("content", ["[]", '"counts"', "3"])
def test_a_dataset_json_that_is_no_object_is_one_line(tmp_path, content):
    root = make_image_folder(tmp_path / "images", classes=2, per_class=4)
    convert(str(root), str(tmp_path / "records"), shards=1, validation_shards=1,
            validation_fraction=0.25, seed=0, image_size=8)
    (tmp_path / "records" / "dataset.json").write_text(content)
    with pytest.raises(UserError, match=r"dataset.json holds a JSON \w+, not the object .*: "
                                        "remove it"):
        list_tfrecords(str(tmp_path / "records"), image_size=None)


def test_file_sharding_reads_what_the_check_counted(tmp_path):
    import tensorflow as tf

    # Uneven shards (6 files of 5 or 4 records), so a rank that read other files than the
    # pre-flight check counted would show a different number of records.
    root = make_image_folder(tmp_path / "images", classes=3, per_class=9)
    convert(str(root), str(tmp_path / "records"), shards=6, validation_shards=1,
            validation_fraction=0.0, seed=0, image_size=8)
    listing = list_tfrecords(str(tmp_path / "records"), image_size=None)
    order = file_order(listing.train, seed=3)
    tf.random.set_seed(11)  # a global seed (set by training) must not change the assignment
    for size in (1, 2, 3, 4):
        counted = [files_for_rank(listing.train, World(rank=r, size=size), order)
                   for r in range(size)]
        read = [sum(1 for _ in listing.shard_records(listing.train, World(rank=r, size=size),
                                                     seed=3, by_file=True)) for r in range(size)]
        assert read == [records for _, records in counted]
        files = [path for paths, _ in counted for path in paths]
        assert sorted(files) == sorted(map(str, listing.train.sources))  # disjoint, complete
    assert sum(read) == listing.train.num_samples == 27


def test_more_ranks_than_tfrecord_files_is_refused(tmp_path):
    root = make_image_folder(tmp_path / "images", classes=2, per_class=6)
    convert(str(root), str(tmp_path / "records"), shards=2, validation_shards=1,
            validation_fraction=0.2, seed=0, image_size=8)
    listing = list_tfrecords(str(tmp_path / "records"), image_size=None)
    with pytest.raises(UserError, match="3 ranks but only 2 training TFRecord file"):
        build_pipelines(listing, World(rank=0, size=3), batch_size=1,
                        validation_batch_size=0, seed=0)
    # Sharding by example works with any number of ranks.
    build_pipelines(listing, World(rank=2, size=3), batch_size=1,
                    validation_batch_size=0, seed=0,
                    tfrecord_sharding="example")


def test_converter_refuses_to_overwrite(tmp_path):
    root = make_image_folder(tmp_path / "images", classes=2, per_class=4)
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        convert(str(root), str(tmp_path / "records"), shards=1, validation_shards=1,
                validation_fraction=0.2, seed=0, image_size=8)


@pytest.mark.parametrize("fraction, size, message", [
    (-0.5, 8, "--validation-fraction must be in [0, 1), got -0.5"),
    (1.0, 8, "--validation-fraction must be in [0, 1), got 1.0"),
    (0.2, 0, "--image-size must be at least 1, got 0")])
def test_converter_refuses_what_training_refuses(tmp_path, fraction, size, message):
    root = make_image_folder(tmp_path / "images", classes=2, per_class=3)
    with pytest.raises(UserError, match=re.escape(message)):
        convert(str(root), str(tmp_path / "records"), shards=1, validation_shards=1,
                validation_fraction=fraction, seed=0, image_size=size)
    assert not list(tmp_path.glob("records*"))  # nothing written


@pytest.mark.parametrize("flags, message", [
    (["--max-resolution", "big"], "argument --max-resolution: a number of pixels or off, not "
                                  "'big' (see --help)"),
    (["--max-resolution", "-3"], "--max-resolution must be at least 1 (or off), got -3"),
    (["--jpeg-quality", "101"], "--jpeg-quality must be in 1..100, got 101")])
def test_a_bad_size_limit_is_one_line(tmp_path, flags, message):
    from hvdtrain.tfrecords import run

    with pytest.raises(UserError) as error:
        run(["--data-dir", str(tmp_path / "images"), "--out", str(tmp_path / "records"), *flags])
    assert str(error.value) == message
    assert not list(tmp_path.glob("records*"))  # nothing written


@pytest.mark.integration
def test_tfrecords_and_run_directory_on_a_url_file_system(tmp_path):
    """gs:// as TPU jobs use it, through TensorFlow's in-memory ram:// file system (no network)."""
    import dataclasses

    import tensorflow as tf

    from hvdtrain.training import train
    from hvdtrain.cnn import CLASSIFIER
    from hvdtrain.cnn import tiny
    from hvdtrain.runtime import Runtime, configure_devices

    root = make_image_folder(tmp_path / "images", classes=2, per_class=10)
    local = tmp_path / "records"
    convert(str(root), str(local), shards=2, validation_shards=1, validation_fraction=0.2,
            seed=0, image_size=8)
    remote = f"ram://{tmp_path.name}/records"
    tf.io.gfile.makedirs(remote)
    for path in local.iterdir():
        tf.io.gfile.copy(str(path), f"{remote}/{path.name}", overwrite=True)
    listing = list_tfrecords(remote, image_size=None)
    folder = list_image_folder(str(root), image_size=8, validation_fraction=0.2, seed=0,
                               on_bad_image="skip")  # the split the converter wrote
    assert (listing.train.num_samples, listing.validation.num_samples) == (
        folder.train.num_samples, folder.validation.num_samples)
    assert all(str(path).startswith("ram://") for path in listing.train.sources)

    run_dir = f"ram://{tmp_path.name}/run"
    config = dataclasses.replace(tiny(), tfrecords=remote, run_dir=run_dir, epochs=2,
                                 batch_size=4, tfrecord_sharding="example")
    runtime = Runtime(World(), configure_devices(World(), None))
    result = train.run("test", config, runtime, CLASSIFIER)
    assert [row["epoch"] for row in result.rows] == [1, 2]
    for name in ("config.json", "metrics.json", "model.keras", "checkpoints/checkpoint"):
        assert tf.io.gfile.exists(f"{run_dir}/{name}"), name
    resumed = train.run("test", dataclasses.replace(config, epochs=3), runtime, CLASSIFIER)
    assert resumed.initial_epoch == 2 and [r["epoch"] for r in resumed.rows] == [1, 2, 3]


# --- TFRecords without validation shards -----------------------------------------------------------
def write_numbered_shards(directory, num_shards: int, per_shard: int) -> None:
    """Shards whose records carry an ``id`` (0, 1, ... through the shards in name order)."""
    import tensorflow as tf

    png = (make_image_folder(directory / "_image", classes=2, per_class=1) / "zero" /
           "000.png").read_bytes()
    for shard in range(num_shards):
        with tf.io.TFRecordWriter(str(directory / f"part-{shard:03d}.tfrecord")) as writer:
            for index in range(per_shard):
                record_id = shard * per_shard + index
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[png])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[record_id % 2])),
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[record_id])),
                })).SerializeToString())


def record_ids(listing, split, world, *, by_file: bool) -> list[int]:
    import tensorflow as tf

    parse = lambda record: tf.io.parse_single_example(  # noqa: E731
        record, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"]
    return [int(i) for i in
            listing.shard_records(split, world, seed=5, by_file=by_file).map(parse)]


@pytest.mark.parametrize("num_shards, fraction, whole", [(10, 0.2, True), (4, 0.2, False),
                                                           (3, 0.1, False)])
def test_tfrecords_without_validation_shards_hold_out_the_fraction(tmp_path, num_shards, fraction,
                                                                   whole):
    write_numbered_shards(tmp_path, num_shards, per_shard=10)
    total = num_shards * 10
    listing = list_tfrecords(str(tmp_path / "*.tfrecord"), image_size=8,
                             validation_fraction=fraction, seed=3)
    assert listing.validation.num_samples == round(total * fraction)
    assert listing.train.num_samples + listing.validation.num_samples == total
    assert ("shard(s) held out" if whole else "records held out") in listing.description
    validation = record_ids(listing, listing.validation, World(), by_file=False)
    assert len(validation) == listing.validation.num_samples
    # Training, read by file over 2 ranks and by example: each rank reads what was counted for
    # it, the ranks are disjoint, and nothing validates that also trains.
    order = file_order(listing.train, seed=5)
    by_file = [record_ids(listing, listing.train, World(rank=r, size=2), by_file=True)
               for r in range(2)]
    assert [len(ids) for ids in by_file] == [
        files_for_rank(listing.train, World(rank=r, size=2), order)[1] for r in range(2)]
    by_example = [record_ids(listing, listing.train, World(rank=r, size=2), by_file=False)
                  for r in range(2)]
    for ids in (by_file, by_example):
        train = ids[0] + ids[1]
        assert sorted(train + validation) == list(range(total))
    # The same split on every call (every rank lists the same shards with the same seed).
    again = list_tfrecords(str(tmp_path / "*.tfrecord"), image_size=8,
                           validation_fraction=fraction, seed=3)
    assert record_ids(again, again.validation, World(), by_file=False) == validation


def test_tfrecords_validation_fraction_zero_keeps_none(tmp_path):
    write_numbered_shards(tmp_path, 10, per_shard=4)
    listing = list_tfrecords(str(tmp_path), image_size=8, validation_fraction=0.0)
    assert (listing.train.num_samples, listing.validation.num_samples) == (40, 0)
    assert "no validation" in listing.description


# --- the cache decision ----------------------------------------------------------------------------
GB = 10**9


def test_auto_cache_never_holds_more_than_the_memory_budget():
    from hvdtrain.data.cache import choose_cache

    auto, fast_disk = CacheSetting("auto"), CacheSetting.parse("disk:/fast")
    common = dict(local_size=4, disk_dir="/scratch")
    fits = choose_cache(auto, bytes_per_rank=2 * GB, memory_budget=8 * GB, disk_free=0, **common)
    assert fits.kind == "memory" and "8.0 GB decoded <= 8.0 GB budget" in fits.reason
    # 4 local ranks x 2.1 GB > 8 GB: never memory, whatever the disk.
    for disk_free, kind in ((100 * GB, "disk"), (9 * GB, "off"), (None, "off")):
        choice = choose_cache(auto, bytes_per_rank=int(2.1 * GB), memory_budget=8 * GB,
                              disk_free=disk_free, **common)
        assert choice.kind == kind and "8.4 GB decoded > 8.0 GB budget" in choice.reason, choice
    assert choose_cache(auto, bytes_per_rank=3 * GB, memory_budget=8 * GB,
                        disk_free=100 * GB, **common).directory == "/scratch"
    # What the user asks for is what they get, with the size in the reason.
    assert choose_cache(CacheSetting("memory"), bytes_per_rank=9 * GB, memory_budget=GB,
                        disk_free=0, **common).kind == "memory"
    assert choose_cache(fast_disk, bytes_per_rank=GB, memory_budget=GB, disk_free=4 * GB,
                        **common).directory == "/fast"
    # ... unless it cannot fit: the 4 local ranks' share on a disk with less free.
    with pytest.raises(RankError, match=r"^--cache disk needs 4.0 GB in /fast \(1.0 GB decoded "
                       r"per rank x 4 local rank\(s\)\), which has 4.0 GB free"):
        choose_cache(fast_disk, bytes_per_rank=GB, memory_budget=GB, disk_free=4 * GB - 1,
                     **common)
    assert choose_cache(CacheSetting("off"), bytes_per_rank=1, memory_budget=GB, disk_free=0,
                        **common).kind == "off"


def test_the_banner_names_the_limit_that_decided():
    from hvdtrain.data.cache import choose_cache

    choice = choose_cache(CacheSetting("auto"), bytes_per_rank=448 * 10**6, local_size=2,
                          memory_budget=300 * 10**6, disk_free=80 * GB, disk_dir="/tmp",
                          budget_source="half of Slurm --mem 600M")
    assert choice.describe() == (
        "cache: disk in /tmp (auto: 896.0 MB decoded > 300.0 MB budget: half of Slurm --mem "
        "600M for 2 local rank(s); /tmp has 80.0 GB free)")


@pytest.mark.parametrize("flag", ["ram", "disk:", "memory:/x", "auto:/x", ""])
def test_bad_cache_flags_are_one_line_errors(flag):
    with pytest.raises(ValueError, match="--cache must be memory, disk, disk:DIR, off or auto"):
        ImageConfig(cache=flag)


def test_the_budget_decides_for_a_real_listing(tmp_path):
    from hvdtrain.data import choose_data_cache

    root = make_image_folder(tmp_path / "data", classes=2, per_class=50)
    listing = list_image_folder(str(root), image_size=32, validation_fraction=0.2, seed=0,
                                on_bad_image="skip")
    world = World(rank=0, size=2, local_size=2)
    # This rank: every other training file, and 8 validation samples.
    decoded = (len(listing.train.sources[0::2]) + 8) * 32 * 32 * 3
    auto = CacheSetting("auto")
    enough = choose_data_cache(listing, world, auto, budget_gb=2 * decoded / 1e9,
                               validation_samples=8)
    short = choose_data_cache(listing, world, auto, budget_gb=(2 * decoded - 1) / 1e9,
                              validation_samples=8)
    assert enough.kind == "memory"
    assert short.kind != "memory"
    embedded = list_data(ImageConfig())  # in memory already
    assert choose_data_cache(embedded, world, CacheSetting("memory"), budget_gb=None,
                             validation_samples=0).kind == "off"


def test_a_disk_cache_is_written_per_process(tmp_path):
    """Stale directories of gone processes: test_scratch."""
    from hvdtrain.data.cache import CacheChoice

    root = make_image_folder(tmp_path / "data", classes=2, per_class=8)
    listing = list_image_folder(str(root), image_size=8, validation_fraction=0.25, seed=0,
                                on_bad_image="skip")
    # Batches that make up whole passes: two passes then hold the same samples.
    half = listing.train.num_samples // 2
    pipelines = build_pipelines(listing, World(), batch_size=half, validation_batch_size=1,
                                seed=0,
                                cache=CacheChoice("disk", "test", str(tmp_path)))
    first = [batch[1].tolist() for batch in pipelines.train.take(2).as_numpy_iterator()]
    list(pipelines.validation.as_numpy_iterator())
    [mine] = tmp_path.glob(f"hvdtrain-cache-{socket.gethostname()}-*")
    assert any(name.startswith("training") for name in os.listdir(mine))
    assert any(name.startswith("validation") for name in os.listdir(mine))
    # Later passes read the cache: the same samples, in another order.
    later = [batch[1].tolist() for batch in pipelines.train.skip(2).take(2).as_numpy_iterator()]
    assert sorted(sum(first, [])) == sorted(sum(later, []))


@pytest.mark.parametrize("source", ["folder", "tfrecords"])
@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_a_full_store_serves_new_orders_without_the_files(tmp_path, source, cache):
    """Once a rank's share is stored, passes are new permutations of it read from the store: the
    source's files can be gone. A second iterator at any moment reads alongside."""
    import shutil

    from hvdtrain.data.cache import CacheChoice

    root = make_image_folder(tmp_path / "data", classes=2, per_class=24)
    if source == "folder":
        listing = list_image_folder(str(root), image_size=8, validation_fraction=0.25, seed=0,
                                    on_bad_image="skip")
    else:
        convert(str(root), str(tmp_path / "records"), shards=3, validation_shards=1,
                validation_fraction=0.25, seed=0, image_size=8)
        listing = list_tfrecords(str(tmp_path / "records"), image_size=8)
    # Batches of one: a pass is then whole batches whatever the split's share.
    pipelines = build_pipelines(listing, World(), batch_size=1, validation_batch_size=4,
                                seed=0,
                                cache=CacheChoice(cache, "test", str(tmp_path)))
    per_pass = listing.train.num_samples
    batches = pipelines.train.as_numpy_iterator()
    # Pixels name a sample here: each pass's samples, summed pixel by pixel per image.
    first = [image.sum() for _ in range(per_pass) for image in next(batches)[0]]
    second_reader = pipelines.train.as_numpy_iterator()
    next(second_reader)
    validation = [batch[0].sum() for batch in pipelines.validation.as_numpy_iterator()]
    shutil.rmtree(root)
    shutil.rmtree(tmp_path / "records", ignore_errors=True)
    passes = [[image.sum() for _ in range(per_pass) for image in next(batches)[0]]
              for _ in range(2)]
    assert all(sorted(seen) == sorted(first) for seen in passes)
    assert first != passes[0] != passes[1]
    assert [batch[0].sum() for batch in pipelines.validation.as_numpy_iterator()] == validation


@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_undecodable_samples_stay_weight_0_blanks_in_every_pass_of_a_store(tmp_path, cache):
    """A sample that did not decode in the first pass is stored as failed: every later pass
    (read from the store in batches) brings it back as a blank of weight 0, the others intact."""
    from hvdtrain.data.cache import CacheChoice

    root = make_image_folder(tmp_path / "data", classes=2, per_class=12)
    bad = add_undecodable_files(root, per_class=3)
    listing = list_image_folder(str(root), image_size=8, validation_fraction=0.0, seed=0,
                                on_bad_image="skip")
    pipelines = build_pipelines(listing, World(), batch_size=5, validation_batch_size=0,
                                seed=0,
                                cache=CacheChoice(cache, "test", str(tmp_path)))
    samples = pipelines.train.unbatch().as_numpy_iterator()
    passes = [[next(samples) for _ in range(listing.train.num_samples)] for _ in range(3)]
    good = [sorted(int(image.sum()) for image, _, weight in one if weight) for one in passes]
    blanks = [[image for image, label, weight in one if not weight] for one in passes]
    assert [len(some) for some in blanks] == [len(bad)] * 3
    assert all(not image.any() for some in blanks for image in some)
    assert len(good[0]) == listing.train.num_samples - len(bad) and good[0] == good[1] == good[2]
    orders = [[int(image.sum()) for image, _, _ in one] for one in passes]
    assert orders[1] != orders[2]  # read from the store, in a new order


def test_two_iterators_at_once_never_mark_a_good_sample_failed(tmp_path):
    """A second iterator while the first pass is storing (batch norm's recompute, the
    autoencoder's picture) with undecodable files about: the store marks as failed exactly the
    files that do not decode (it once marked whatever the other iterator had last numbered)."""
    from hvdtrain.data.cache import CacheChoice

    root = make_image_folder(tmp_path / "data", classes=2, per_class=80, sizes=(8,))
    bad = add_undecodable_files(root, per_class=10)
    listing = list_image_folder(str(root), image_size=8, validation_fraction=0.0, seed=0,
                                on_bad_image="skip")
    pipelines = build_pipelines(listing, World(), batch_size=1, validation_batch_size=0,
                                seed=0,
                                cache=CacheChoice("memory", "test", str(tmp_path)))
    samples = listing.train.num_samples
    first, second = iter(pipelines.train), iter(pipelines.train)
    for _ in range(samples):  # the first pass of both, a batch each in turn
        next(first), next(second)
    later = [[next(first) for _ in range(samples)] for _ in range(2)]  # read from the store
    assert [sum(1 for _, _, weight in one if not weight.numpy()[0]) for one in later] == \
        [len(bad)] * 2
    store = pipelines.pipeline_state[-1]
    positions, labels = (tensor.numpy() for tensor in store.labels.export())
    failed = sorted(listing.sample_namer(listing.train, World(), by_file=True)(int(position))
                    for position in positions[labels < 0])
    assert failed == sorted(bad)


@pytest.mark.integration
def test_augmentation_crops_anew_every_epoch_and_rank_and_validation_never_changes(tmp_path):
    """Every image of this folder is the same picture: what differs between samples, passes and
    ranks is the augmentation alone."""
    import tensorflow as tf

    from hvdtrain.data.augment import stored_shape
    from hvdtrain.data.cache import CacheChoice

    picture = tf.cast(tf.random.stateless_uniform([40, 40, 3], seed=[1, 2], maxval=256,
                                                  dtype=tf.int32), tf.uint8)
    encoded = tf.io.encode_png(picture).numpy()  # lossless: the center crop is known exactly
    for label in ("a", "b"):
        (tmp_path / "data" / label).mkdir(parents=True)
        for index in range(8):
            (tmp_path / "data" / label / f"{index}.png").write_bytes(encoded)
    listing = list_image_folder(str(tmp_path / "data"), image_size=16, validation_fraction=0.25,
                                seed=0, on_bad_image="skip")
    assert stored_shape(listing.image_shape) == (18, 18, 3)

    def passes(rank: int, cache: str) -> tuple[list, list]:
        pipelines = build_pipelines(listing, World(rank=rank, size=2), batch_size=6,
                                    validation_batch_size=1, seed=0,
                                    cache=CacheChoice(cache, "test", str(tmp_path)),
                                    augment=True)
        batches = pipelines.train.as_numpy_iterator()
        train = [next(batches)[0] for _ in range(2)]  # two batches of 6 (a rank holds 6 or 7)
        validation = [batch[0] for batch in pipelines.validation.as_numpy_iterator()]
        assert train[0].shape == (6, 16, 16, 3) and validation[0].shape == (1, 16, 16, 3)
        return train, validation

    # Samples, passes and ranks all see different crops of the same picture: cut from the store,
    # or (no cache) while decoding.
    for cache in ("memory", "off"):
        train, validation = passes(0, cache)
        other_rank, _ = passes(1, cache)
        assert len({image.tobytes() for image in train[0]}) == 6
        assert not np.array_equal(train[0], train[1])
        assert not np.array_equal(train[0], other_rank[0])
    # Validation is the same center crop, run after run and with any cache.
    center = tf.image.resize_with_crop_or_pad(
        tf.cast(tf.clip_by_value(tf.round(tf.image.resize(picture, [18, 18])), 0, 255),
                tf.uint8), 16, 16).numpy()
    for _, again in (passes(0, "memory"), passes(0, "off"), passes(0, "disk")):
        assert all(np.array_equal(image, center) for batch in again for image in batch)
    assert all(np.array_equal(image, center) for batch in validation for image in batch)


@pytest.mark.parametrize("window, output, ratio", [
    ((448, 448), (224, 224), 2), ((447, 900), (224, 224), 1), ((900, 447), (224, 224), 1),
    ((1500, 2000), (256, 256), 4), ((2047, 2048), (256, 256), 4), ((2048, 2048), (256, 256), 8),
    ((5000, 5000), (224, 224), 8), ((375, 500), (256, 256), 1), ((375, 500), (73, 73), 4)])
def test_a_jpeg_decodes_at_the_smallest_scale_that_keeps_the_output_size(window, output, ratio):
    from hvdtrain.data.images import DCT_RATIOS, dct_ratio_index

    assert DCT_RATIOS[int(dct_ratio_index(*window, *output))] == ratio


def _photo_jpeg(height: int, width: int) -> bytes:
    """One of scikit-learn's sample photographs resized to ``height`` x ``width``, as a JPEG."""
    import tensorflow as tf
    from sklearn.datasets import load_sample_images

    photo = tf.image.resize(load_sample_images().images[0], [height, width], antialias=True)
    return tf.io.encode_jpeg(tf.cast(tf.round(photo), tf.uint8), quality=90).numpy()


def test_a_large_jpeg_decodes_scaled_down_close_to_a_whole_decode_and_png_as_before():
    """The store's decode (and validation's) and a training crop of a 4x-larger JPEG decode at a
    DCT scale: exactly the scaled decode resized, within a few levels of decoding whole and
    resizing, the same every time; a PNG decodes whole as before. (Closer to an antialiased
    resize than a bilinear resize of the whole decode is: that one aliases.)"""
    import tensorflow as tf

    from hvdtrain.data.augment import _crop_window, decode_random_crop
    from hvdtrain.data.images import decode_image

    encoded = _photo_jpeg(320, 480)
    whole = tf.io.decode_jpeg(encoded, channels=3)

    def resized(pixels, size, antialias=False):
        pixels = tf.image.resize(pixels, size, antialias=antialias)
        return tf.cast(tf.clip_by_value(tf.round(pixels), 0, 255), tf.uint8).numpy()

    def mean_abs_difference(first, second) -> float:
        return float(np.abs(first.astype(int) - second.astype(int)).mean())

    stored = decode_image(encoded, (73, 73, 3)).numpy()  # 320/73: 1/4 scale
    assert np.array_equal(stored, resized(tf.io.decode_jpeg(encoded, channels=3, ratio=4),
                                          [73, 73]))
    assert np.array_equal(stored, decode_image(encoded, (73, 73, 3)).numpy())
    assert mean_abs_difference(stored, resized(whole, [73, 73], antialias=True)) < 4

    seeds = tf.constant([3, 4], tf.int64)
    crop = decode_random_crop(encoded, seeds, (32, 32, 3)).numpy()
    begin, size = (tensor.numpy() for tensor in _crop_window(tf.shape(whole), seeds))
    unscaled = tf.slice(whole, begin, size)
    flipped = bool(tf.image.stateless_random_flip_left_right(  # the flip augment.py draws
        tf.ones([1, 2, 1]) * [[[0.0], [1.0]]], seed=tf.reverse(seeds, [0]))[0, 0, 0] == 1)
    unscaled = tf.image.flip_left_right(unscaled) if flipped else unscaled
    ratio = 2 ** int(np.log2(min(size[0] // 32, size[1] // 32, 8)))
    assert ratio > 1 and crop.shape == (32, 32, 3)
    top, left = begin[:2] // ratio
    bottom, right = -(-(begin[:2] + size[:2]) // ratio)
    scaled = tf.io.decode_and_crop_jpeg(encoded, [top, left, bottom - top, right - left],
                                        channels=3, ratio=ratio)
    scaled = tf.image.flip_left_right(scaled) if flipped else scaled
    assert np.array_equal(crop, resized(scaled, [32, 32]))
    antialiased = resized(unscaled, [32, 32], antialias=True)
    assert mean_abs_difference(crop, antialiased) < min(
        8, mean_abs_difference(resized(unscaled, [32, 32]), antialiased))

    png = tf.io.encode_png(whole).numpy()
    assert np.array_equal(decode_image(png, (73, 73, 3)).numpy(), resized(whole, [73, 73]))


def test_the_store_keeps_the_central_square_at_the_aspect_ratio_and_resamples_no_exact_one():
    """--augment stores an image's central square (the image resized to the stored shorter side,
    its center cut out: no stretching), a JPEG decoding only that square (scaled down when at
    least twice the output), a PNG the same pixels as the JPEG's own decode; a square of exactly
    the stored size, what shards converted for it hold, comes back unresampled."""
    import tensorflow as tf

    from hvdtrain.data.images import decode_center_square

    def resized(pixels, size):
        pixels = tf.image.resize(pixels, size)
        return tf.cast(tf.clip_by_value(tf.round(pixels), 0, 255), tf.uint8).numpy()

    encoded = _photo_jpeg(375, 500)  # a 4:3 photo: its central square is columns 62..436
    whole = tf.io.decode_jpeg(encoded, channels=3).numpy()
    square = decode_center_square(encoded, (73, 73, 3)).numpy()  # 375/73: 1/4 scale
    scaled = tf.io.decode_and_crop_jpeg(encoded, [0, 15, 94, 95], channels=3, ratio=4)
    assert np.array_equal(square, resized(scaled, [73, 73]))
    png = tf.io.encode_png(whole).numpy()
    assert np.array_equal(decode_center_square(png, (64, 64, 3)).numpy(),
                          resized(whole[:, 62:437], [64, 64]))
    assert np.array_equal(decode_center_square(png, (375, 375, 3)).numpy(), whole[:, 62:437])
    tall = tf.io.encode_png(whole.transpose(1, 0, 2)).numpy()  # 500x375: rows 62..436
    assert np.array_equal(decode_center_square(tall, (375, 375, 3)).numpy(),
                          whole.transpose(1, 0, 2)[62:437])
    converted = tf.io.encode_jpeg(resized(whole, [256, 341]), quality=90).numpy()
    exact = decode_center_square(converted, (256, 256, 3)).numpy()
    assert np.array_equal(exact, tf.io.decode_and_crop_jpeg(converted, [0, 42, 256, 256],
                                                             channels=3).numpy())
    # The window's decode differs from slicing a whole decode only where libjpeg upsamples
    # colour at the window's edge.
    sliced = tf.io.decode_jpeg(converted, channels=3).numpy()[:, 42:298]
    assert np.abs(exact.astype(int) - sliced.astype(int)).mean() < 0.5


def test_a_disk_cache_failure_is_found_in_tensorflows_words_whatever_its_directory():
    from hvdtrain.data.store import disk_cache_failure

    said = ("Graph execution error:\n\nError in user-defined function passed to ParallelMapDatasetV2"
            ": OSError: [Errno 28] cannot write the disk cache in /scratch/my job: 2/training: "
            "No space left on device\nTraceback (most recent call last):\n  File ...")
    assert disk_cache_failure(Exception(said)) == (
        "cannot write the disk cache in /scratch/my job: 2/training: No space left on device; "
        "free space there, point --cache disk:DIR or TMPDIR at a larger local disk, or use "
        "--cache memory or off")
    assert disk_cache_failure(Exception("OSError: [Errno 5] Input/output error")) is None


def test_the_flags_name_one_source_and_every_kind_has_its_lister(tmp_path):
    """ImageConfig.source is the one typed value the rest asks (not the three flags), and each
    kind of source is a row of data.sources.LISTERS."""
    from hvdtrain.data.source import KINDS, DataSource
    from hvdtrain.data.sources import LISTERS

    assert set(LISTERS) == set(KINDS)
    folder = ImageConfig(data_dir=str(tmp_path)).source
    assert folder == DataSource("folder", str(tmp_path)) and folder.from_files
    assert folder.described() == f"image folder {os.path.realpath(tmp_path)}"
    remote = ImageConfig(tfrecords="gs://bucket/shards").source
    assert remote.described() == "TFRecords gs://bucket/shards"  # a URL as given
    digits = ImageConfig().source
    assert digits == DataSource("embedded", "digits") and not digits.from_files
    assert digits.label == digits.described() == "embedded digits"
    with pytest.raises(ValueError, match="give either --data-dir or --tfrecords, not both"):
        ImageConfig(data_dir="a", tfrecords="b")
