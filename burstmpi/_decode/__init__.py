"""Decode over a KV cache sharded across ranks: ``KVCache`` (``burstmpi.KVCache``).

``cache``: the cache, its prefill and its decode calls; ``slots``: where each token lives
on its rank (the window's ring of slots, the sinks); ``exchange``: the decode's one
collective and the merge of the ranks' partials.
"""
