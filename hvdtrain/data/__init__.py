"""Input data: the embedded digits, synthetic images, an image folder, or TFRecord shards.

Every source becomes the same two ``tf.data`` pipelines per rank. A new source is a kind in
``source.py``, a lister in ``sources.py`` (with its ``Listing`` subclass) and its test. The
package, by question:

    listing.py   what a source found (``Listing``, ``Split``) and what every source answers
    embedded.py  the digits and synthetic sets, in memory
    folder.py    an image folder, listed once by rank 0
    images.py    the image formats read (PNG/JPEG/GIF/BMP) and decoding them
    records.py   TFRecord shards: the format (hvdtrain.tfrecords writes it) and the reader
    source.py    the source the flags name, as one typed value (``ImageConfig.source``)
    sources.py   one lister per kind of source; rank 0 lists, every rank receives the listing
    shares.py    which samples a rank owns
    cache.py     where decoded images are kept between epochs, sized against the job's memory
    store.py     the decoded samples kept, by position, in memory or on local disk
    augment.py   random-resized crops and flips for training, a center crop for validation
    pipeline.py  a listing -> this rank's training and validation pipelines
"""
import importlib

# Resolved on first use: importing one module of the package (the converter imports folder.py
# and records.py) must not import them all, the pipeline included.
_PUBLIC = {"CacheChoice": "cache", "choose_data_cache": "cache", "Listing": "listing",
           "Split": "listing", "split_indices": "listing", "ImageDatasets": "pipeline",
           "build_pipelines": "pipeline", "list_data": "sources", "load_listing": "sources",
           "disk_cache_failures_in_one_line": "store"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"hvdtrain.data.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module 'hvdtrain.data' has no attribute {name!r}")
