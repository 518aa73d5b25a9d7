"""What the fault tests do to a host, and undo.

- ``pull_link``: the host's cable pulled: its bridge port set down, so the NIC inside loses
  carrier and nothing it sends or is sent arrives. Nothing tells TCP: connections to and from
  the host see only silence, as on a real cluster.
- ``lossy_link``: each packet crossing the host's link dropped with probability PCT %, both
  ways, by nftables (``numgen random mod 100 < PCT drop``) on the ``ingress`` hook of each
  end: the bridge port for what the host sends, the NIC inside for what it receives. Ingress
  hooks drop packets already "on the wire", so the senders' TCP sees loss, not a local error
  (an ``output`` hook would refuse the send inside the host's own stack). The kernel here
  has no ``sch_netem``, which would be the usual tool.
- ``kill_host``: SIGKILL to every process of the host (proxy and ranks), as a node that
  crashes or is rebooted.
Each returns a function that undoes it (a no-op for ``kill_host``), so a test can restore
the cluster whatever happened; the ``hosts`` fixture then checks that every host reaches the
head again (``Cluster.wait_reachable``) before the next test launches anything.
"""

import shutil

from .shell import run

__all__ = ["pull_link", "lossy_link", "kill_host", "dropped", "missing_nft", "LOSS_TABLE"]

LOSS_TABLE = "burstmpi_loss"  # nftables table name, one per namespace that has one


def pull_link(cluster, host):
    """Set ``host``'s bridge port down; return the undo (set it up again, and wait until the
    host reaches the head: the next test's launch must not race the link's return)."""
    run(["ip", "link", "set", host.port, "down"])

    def undo():
        run(["ip", "link", "set", host.port, "up"])
        cluster.wait_reachable([host])
    return undo


def missing_nft():
    """True where nftables' ``nft`` is not installed (the loss fault needs it)."""
    return shutil.which("nft") is None


def _loss_rules(device, pct):
    return (f"table netdev {LOSS_TABLE} {{\n"
            f"  chain ingress {{ type filter hook ingress device {device} priority 0; policy accept;\n"
            f"    numgen random mod 100 < {int(pct)} counter drop\n  }}\n}}\n")


def lossy_link(cluster, host, pct):
    """Drop ``pct`` % of the packets in each direction of ``host``'s link; return the undo."""
    if not 0 < pct < 100:
        raise ValueError(f"pct: expected a percentage between 0 and 100, got {pct}")
    # The table's name carries the slot: the root namespace is shared with other clusters.
    root_table = f"{LOSS_TABLE}_{host.port}"
    run(["nft", "-f", "-"], input=_loss_rules(host.port, pct).replace(LOSS_TABLE, root_table))
    run(["ip", "netns", "exec", host.netns, "nft", "-f", "-"], input=_loss_rules("eth0", pct))

    def undo():
        run(["nft", "delete", "table", "netdev", root_table], check=False)
        run(["ip", "netns", "exec", host.netns, "nft", "delete", "table", "netdev", LOSS_TABLE], check=False)
    return undo


def dropped(cluster, host):
    """Packets the loss rules dropped so far: (sent by the host, sent to it)."""
    def count(argv):
        out = run(argv, check=False).stdout
        words = out.split()
        return int(words[words.index("packets") + 1]) if "packets" in words else 0
    return (count(["nft", "list", "table", "netdev", f"{LOSS_TABLE}_{host.port}"]),
            count(["ip", "netns", "exec", host.netns, "nft", "list", "table", "netdev", LOSS_TABLE]))


def kill_host(cluster, host):
    """SIGKILL every process on ``host``; return the undo (nothing to undo)."""
    host.kill_all()
    return lambda: None
