"""How blocks travel between ranks, and where the ranks are.

``comm``: the private communicator, packets and the double-buffered channels the ring
posts its transfers on; ``mpi``: the MPI transports (host buffers, CUDA-aware, staged
through host memory); ``shm``: the same channels for the ranks of one node,
reading packets in place from a shared window; ``nccl``: NCCL communicators bootstrapped
over MPI and the event-ordered GPU transport; ``nodes``: which ranks share a node;
``alltoall``: sequence shards to head shards inside a group (head parallelism);
``slowlinks``: links between nodes slowed to a given bandwidth (a simulation aid).
"""
