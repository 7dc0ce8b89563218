"""Listing, splitting and sharding the data, with every rank simulated in one process."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hvdtrain.config import ImageConfig
from hvdtrain.data import (build_pipelines, list_data, list_image_folder, list_tfrecords,
                           shard_records, split_indices, tfrecord_file_order,
                           tfrecord_files_for_rank)
from hvdtrain.errors import UserError
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


def test_split_is_deterministic_disjoint_and_complete():
    train, validation = split_indices(1000, 0.2, seed=7)
    again_train, _ = split_indices(1000, 0.2, seed=7)
    assert np.array_equal(train, again_train)
    assert len(validation) == 200
    assert sorted(np.concatenate([train, validation])) == list(range(1000))
    assert not np.array_equal(train, split_indices(1000, 0.2, seed=8)[0])


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shards_are_disjoint_and_cover_the_split(size):
    listing = list_data(ImageConfig())
    shards = [ids_of(shard_records(listing.train, World(rank=r, size=size), seed=0,
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
                                    batch_size=batch, validation_batch_size=batch,
                                    validation_steps=0, seed=0, cache=True)
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
                                validation_batch_size=4, validation_steps=2, seed=0, cache=True)
    images, labels, weights = next(iter(pipelines.train))
    assert images.shape == (4, 16, 16, 3) and images.dtype.name == "uint8"
    assert set(labels.numpy()) <= {0, 1, 2}
    assert weights.numpy().tolist() == [1.0] * 4  # every file decoded
    assert len(list(pipelines.validation)) == 2


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


def test_non_image_files_are_skipped_and_counted_or_fatal(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=2, per_class=5)
    (root / "zero" / "notes.txt").write_text("not an image")
    (root / "one" / "broken.png").write_bytes(b"garbage that is not a PNG")
    listing = list_image_folder(str(root), image_size=None, validation_fraction=0.2, seed=0,
                                on_bad_image="skip")
    assert listing.train.num_samples + listing.validation.num_samples == 10
    assert listing.notes and "skipped 2 file(s)" in listing.notes[0]
    with pytest.raises(UserError, match="2 file.*--on-bad-image skip"):
        list_image_folder(str(root), image_size=None, validation_fraction=0.2, seed=0,
                          on_bad_image="fail")


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
    validation_steps = (listing.validation.num_samples // size) // batch  # as plan.py derives it
    skipped, names = 0, set()
    for rank in range(size):
        world = World(rank=rank, size=size)
        pipelines = build_pipelines(listing, world, batch_size=batch,
                                    validation_batch_size=batch,
                                    validation_steps=validation_steps, seed=0, cache=True)
        # One full pass over this rank's shard: exactly its planned number of samples, the
        # undecodable ones as weight-0 blanks, so no rank can run short of a batch.
        planned = len(listing.train.sources[rank::size])
        train = list(pipelines.train.unbatch().take(planned).as_numpy_iterator())
        validation = list(pipelines.validation.as_numpy_iterator())
        assert len(validation) == validation_steps  # the same on every rank
        weights = [w for _, _, w in train] + [w for batch_ in validation for w in batch_[2]]
        blanks = [image for image, _, w in train if w == 0]
        assert all(not image.any() for image in blanks)
        for counter in pipelines.decode_failures:
            count, name = counter.take_new()
            skipped += count
            names |= {name} if name else set()
            assert counter.take_new() == (0, None)  # counted once, not again
        assert weights.count(0.0) <= len(bad)
    # Every undecodable training file is counted by the rank that owns it; validation files
    # only up to the validation steps each rank runs.
    train_bad = len(set(bad) & set(listing.train.sources.tolist()))
    assert train_bad <= skipped <= len(bad)
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
    assert (listing.train.num_samples, listing.validation.num_samples) == (24, 6)
    # File sharding: 3 ranks, one whole shard each, all records read exactly once.
    seen = []
    for rank in range(3):
        records = shard_records(listing.train, World(rank=rank, size=3), seed=0, by_file=True)
        seen.append(sum(1 for _ in records))
    assert seen == [8, 8, 8]
    pipelines = build_pipelines(listing, World(rank=1, size=3), batch_size=4,
                                validation_batch_size=2, validation_steps=1, seed=0, cache=True)
    images, labels, weights = next(iter(pipelines.train))
    assert images.shape == (4, 16, 16, 3)


def test_file_sharding_reads_what_the_check_counted(tmp_path):
    import tensorflow as tf

    # Uneven shards (6 files of 5 or 4 records), so a rank that read other files than the
    # pre-flight check counted would show a different number of records.
    root = make_image_folder(tmp_path / "images", classes=3, per_class=9)
    convert(str(root), str(tmp_path / "records"), shards=6, validation_shards=1,
            validation_fraction=0.0, seed=0, image_size=8)
    listing = list_tfrecords(str(tmp_path / "records"), image_size=None)
    order = tfrecord_file_order(listing.train, seed=3)
    tf.random.set_seed(11)  # a global seed (set by training) must not change the assignment
    for size in (1, 2, 3, 4):
        counted = [tfrecord_files_for_rank(listing.train, World(rank=r, size=size), order)
                   for r in range(size)]
        read = [sum(1 for _ in shard_records(listing.train, World(rank=r, size=size), seed=3,
                                             by_file=True)) for r in range(size)]
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
                        validation_batch_size=1, validation_steps=0, seed=0, cache=True)
    # Sharding by example works with any number of ranks.
    build_pipelines(listing, World(rank=2, size=3), batch_size=1,
                    validation_batch_size=1, validation_steps=0, seed=0, cache=True,
                    tfrecord_sharding="example")


def test_converter_refuses_to_overwrite(tmp_path):
    root = make_image_folder(tmp_path / "images", classes=2, per_class=4)
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        convert(str(root), str(tmp_path / "records"), shards=1, validation_shards=1,
                validation_fraction=0.2, seed=0, image_size=8)


def test_tfrecords_and_run_directory_on_a_url_file_system(tmp_path):
    """gs:// as TPU jobs use it, through TensorFlow's in-memory ram:// file system (no network)."""
    import dataclasses

    import tensorflow as tf

    from hvdtrain import train
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
    assert (listing.train.num_samples, listing.validation.num_samples) == (16, 4)
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
