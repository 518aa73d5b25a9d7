"""burstmpi: exact distributed softmax attention over MPI (BurstAttention).

The sequence is split across the ranks of an MPI communicator; blocks travel around a
ring while each rank computes its part of exact attention. See README.md.
"""

from ._api import attention, attention_backward, release_cached, shard, shard_indices, unshard
from ._decode.cache import DecodeStats, KVCache
from ._plan import BurstAttention, PhaseStats, Stats

__all__ = ["attention", "attention_backward", "shard", "unshard", "shard_indices", "release_cached",
           "BurstAttention", "KVCache", "DecodeStats", "PhaseStats", "Stats", "__version__"]

__version__ = "0.1.0"
