"""Which keys each query sees: masks described once, in global positions.

``Causal()``, ``Window(left, right)``, ``Sinks(n)``, ``Chunked(size)``,
``BlockSparse(blocks, block_size)`` and ``PerHead([...])``, combined with ``&`` and ``|``,
go to the attention functions as ``mask=`` (``burstmpi.masks._patterns`` defines each).
Underneath, a mask is lowered to disjoint monotone intervals per row
(``burstmpi.masks._terms``), the form in which the ring's schedule, the CPU tile loops and
the CUDA kernels skip what no query sees (``burstmpi.masks._intervals``). Beside them, where
tokens live: the layouts (``burstmpi.masks._layout``) and packed documents for the bench
(``burstmpi.masks._packing``).
"""

from ._patterns import BlockSparse, Causal, Chunked, Mask, PerHead, Sinks, Window, head_slice

__all__ = ["Mask", "Causal", "Window", "Sinks", "Chunked", "BlockSparse", "PerHead"]
