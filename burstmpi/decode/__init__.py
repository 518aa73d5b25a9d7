"""Decode over a KV cache sharded across ranks: ``KVCache`` (``burstmpi.KVCache``).

``cache``: the cache, its prefill and its decode calls, each merged across ranks by one
collective.
"""
