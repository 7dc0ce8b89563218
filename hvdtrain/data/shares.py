"""Which samples a rank owns: every ``size``-th sample of a split, from its rank on.

The split is shuffled with a seed every rank shares before anyone takes a share, so the shares
are disjoint, cover the split, differ in size by at most one, and hold a random mix of classes.
Shares are taken before decoding: each rank reads and decodes only its own files.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hvdtrain.runtime.base import World

if TYPE_CHECKING:
    import numpy as np


def rank_share(values: np.ndarray, world: World) -> np.ndarray:
    """This rank's every-size-th slice of ``values``. Sliced before TensorFlow sees the list, so
    a rank holds its own share, not the whole list."""
    return values[world.rank::world.size]


def samples_for_rank(total: int, world: World) -> int:
    """How many of ``total`` samples ``rank_share`` (and ``Dataset.shard``) leaves this rank."""
    return total // world.size + (1 if world.rank < total % world.size else 0)
