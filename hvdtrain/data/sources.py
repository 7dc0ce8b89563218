"""Each kind of source's lister (``LISTERS``), and how every rank comes to hold the same listing
of the one the flags name (``ImageConfig.source``, ``data/source.py``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from hvdtrain.data.embedded import embedded_listing, load_embedded
from hvdtrain.data.folder import list_image_folder
from hvdtrain.data.listing import Listing
from hvdtrain.data.records import list_tfrecords
from hvdtrain.errors import UserError, first_line

if TYPE_CHECKING:
    from hvdtrain.training.config import ImageConfig
    from hvdtrain.runtime import Runtime


def _folder(config: ImageConfig) -> Listing:
    return list_image_folder(config.data_dir, image_size=config.image_size,
                             validation_fraction=config.validation_fraction, seed=config.seed,
                             on_bad_image=config.on_bad_image, channels=config.channels or 3,
                             check_images=config.check_images)


def _tfrecords(config: ImageConfig) -> Listing:
    return list_tfrecords(config.tfrecords, image_size=config.image_size,
                          channels=config.channels, validation_fraction=config.validation_fraction,
                          seed=config.seed, augment=config.augment)


def _embedded(config: ImageConfig) -> Listing:
    arrays = load_embedded(config.data, image_size=config.image_size,
                           synthetic_samples=config.synthetic_samples, seed=config.seed)
    return embedded_listing(arrays, config.validation_fraction, config.seed)


#: One lister per kind of source (``data.source.KINDS``): the config -> its ``Listing``.
LISTERS: dict[str, Callable[[ImageConfig], Listing]] = {
    "folder": _folder, "tfrecords": _tfrecords, "embedded": _embedded}


def list_data(config: ImageConfig) -> Listing:
    """Find the samples named by the config. Raises UserError for anything unusable."""
    return LISTERS[config.source.kind](config)


def load_listing(config: ImageConfig, runtime: Runtime) -> Listing:
    """Rank 0 lists and checks the data; every rank receives the same result or the same error.

    Embedded data is deterministic and in memory, so every rank simply loads its own copy.
    """
    if not config.source.from_files:
        return list_data(config)
    return runtime.from_chief(lambda: _list_files(config))


def _list_files(config: ImageConfig) -> Listing:
    try:
        return list_data(config)
    except UserError:
        raise
    except Exception as error:  # unreadable files: a corrupt dataset.json or shard, ...
        if not _is_data_error(error):
            raise
        raise UserError(f"cannot read {config.source.location}: "
                        f"{type(error).__name__}: {first_line(error)}") from None


def _is_data_error(error: Exception) -> bool:
    if isinstance(error, (OSError, ValueError)):  # JSONDecodeError is a ValueError
        return True
    import tensorflow as tf

    return isinstance(error, tf.errors.OpError)  # e.g. DataLossError from a truncated shard
