"""One Linux machine as a cluster of K hosts, for burstmpi's multi-host tests.

Each host is a set of namespaces (network, hostname, IPC, mount) behind a shaped link to a
Linux bridge, and the MPI's launcher (MPICH's or Intel MPI's hydra, Open MPI's PRRTE)
starts ranks on them as it would over ssh. The modules:

- ``shell``: subprocesses with timeouts and errors that name the command;
- ``hosts``: one host's namespaces, link and shaping, made and torn down;
- ``harness``: the cluster (bridge, hosts, hostfile), ``mpiexec`` across it, what is left
  on the hosts (processes, ``/dev/shm``), and the
  ``python -m tests.cluster.harness up|down|run|status`` command line;
- ``mpis``: which MPI this environment holds, and each one's launch line and settings;
- ``faults``: what the fault tests do to a host (pull its link, drop packets, kill it);
- ``launcher`` and ``remote``: the stand-in for ssh that hydra calls, and its far end
  inside a host (the command's output crosses the host's link, as over ssh);
- ``slurm``: a real Slurm on a cluster (slurmctld on the head, a slurmd inside each host,
  munge, a generated ``slurm.conf``), for the batch scripts' tests;
- ``scripts/``: the small MPI programs the tests launch;
- ``conftest``, ``test_cluster`` (healthy links), ``test_faults`` (faults) and
  ``test_slurm`` (the shipped batch scripts under Slurm, with a regression, a time limit
  and a pulled link).

``docs/guide/multihost.md`` says how to run it and what each fault does.
"""
