"""Which keys each query sees.

Today every mask is a sliding window (``causal=``, ``window=``) on global positions inside
packed documents (``cu_seqlens=``); ``burstmpi.masks.intervals`` holds its form as one
visible interval per query and the tile logic that the ring's schedule, the CPU tile loops
and the CUDA kernels share. The module docstring there says why one interval per row
carries everything.
"""
