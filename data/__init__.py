"""Curvature over a dataset: the mean over the batches of a loader (:mod:`.batches`), over
every rank's shard when a ``torch.distributed`` process group is initialised
(:mod:`.ranks`)."""

from .batches import NothingCounted, is_batches, mean, one_batch, over_batches, takes_batches
from .ranks import RankError

__all__ = ["NothingCounted", "RankError", "is_batches", "mean", "one_batch", "over_batches",
           "takes_batches"]
