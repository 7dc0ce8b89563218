"""Input data: the embedded digits, synthetic images, an image folder, or TFRecord shards.

Every source becomes the same two ``tf.data`` pipelines per rank. The package, by question:

    listing.py   what a source found (``Listing``, ``Split``) and what every source answers
    embedded.py  the digits and synthetic sets, in memory
    folder.py    an image folder, listed once by rank 0
    images.py    the image formats read (PNG/JPEG/GIF/BMP) and decoding them
    records.py   TFRecord shards: the format (hvdtrain.tfrecords writes it) and the reader
    sources.py   which source the flags name; rank 0 lists, every rank receives the listing
    shares.py    which samples a rank owns
    cache.py     where decoded images are kept between epochs, sized against the job's memory
    pipeline.py  a listing -> this rank's training and validation pipelines
"""
from hvdtrain.data.cache import CacheChoice, choose_data_cache
from hvdtrain.data.listing import Listing, Split, split_indices
from hvdtrain.data.pipeline import ImageDatasets, build_pipelines
from hvdtrain.data.sources import list_data, load_listing

__all__ = ["CacheChoice", "ImageDatasets", "Listing", "Split", "build_pipelines",
           "choose_data_cache", "list_data", "load_listing", "split_indices"]
