"""The Ray engine at scale: 10,000 simulated clients on one machine, and rounds across 1 to 4 nodes.

* ``clients``: federated PCA with n = k and then each n of ``--clients`` (default 10,000) clients
  (1,000 records each, tau = 5, B = 50), k = ``--cohort`` (default 100) a round, in the one-machine layout of ``rfedray run`` (``bench_engines.measure_engine``: every
  client trained once before the timed rounds; a round loads the records of the clients it samples).
  Reports the median round,
  the peak RSS of every process of the run and the memory per client.
* ``nodes``: a :class:`ray.cluster_utils.Cluster` of a head (no CPU: the driver, accountant) and
  1 to 4 worker nodes of one CPU, each hosting one client actor with 10 clients, all of them trained
  every round (k = 10 x nodes): the same work per node as nodes are added. The cluster layout (an
  accountant actor, every client in a client actor). On a machine with fewer cores than nodes the
  nodes share cores, and the round time then grows with the CPU they share, not with the engine.

Run: ``nice -n 10 python benchmarks/bench_scale.py [--sections clients nodes] [--clients 1000 10000] [--cohort 100]
[--rounds 6]`` (``--clients``: the federation sizes, each measured after one of n = k clients).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import psutil
import ray
import torch
from ray.cluster_utils import Cluster

from actors.session import LOCAL_OBJECT_STORE_BYTES
from bench_engines import measure_engine

MIB = 1024**2
PER_NODE = 10
"""Clients per worker node (one client actor each) in the ``nodes`` section."""


def clients_section(sizes: list[int], k: int, rounds: int) -> None:
    """Rounds of k clients from federations of k clients and of each of ``sizes``, one after the other."""
    results = {}
    with tempfile.TemporaryDirectory() as out:  # each measurement starts a Ray instance of its own
        for n in [k, *sizes]:
            r = results[n] = measure_engine("ray", n, k, rounds, out)
            per_client = (r["peak_rss_gib"] - results[k]["peak_rss_gib"]) * 1024 / (n - k) if n > k else None
            memory = "-" if per_client is None else (f"{per_client:.3f} MiB per added client (its records: "
                                                    f"{1000 * 40 * 4 / MIB:.3f} MiB)")
            print(f"| n = {n}, k = {k} | {r['round_s'] * 1e3:.0f} ms | {r['peak_rss_gib']:.2f} GiB | {memory} | "
                  f"{r['round_s'] / results[k]['round_s']:.2f}x |", flush=True)


def nodes_section(max_nodes: int, rounds: int) -> None:
    times = {}
    for nodes in range(1, max_nodes + 1):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                                "object_store_memory": LOCAL_OBJECT_STORE_BYTES})
        try:
            for _ in range(nodes):
                cluster.add_node(num_cpus=1, object_store_memory=LOCAL_OBJECT_STORE_BYTES)
            ray.init(address=cluster.address, log_to_driver=False)
            n = PER_NODE * nodes
            with tempfile.TemporaryDirectory() as out:
                r = measure_engine("ray", n, n, rounds, out)  # on this process's Ray: the cluster layout
            times[nodes] = r["round_s"]
            print(f"| {nodes} | {n} | {r['round_s'] * 1e3:.0f} ms | {r['train_s'] * 1e3:.0f} ms | "
                  f"{r['round_s'] / times[1]:.2f}x | {r['failed']} |", flush=True)
        finally:
            ray.shutdown()
            address = cluster.address
            cluster.shutdown()
            forget_address(address)


def forget_address(address: str) -> None:
    """Remove the address file that :class:`Cluster` writes for ``ray.init()`` to find it, if it is ours
    (so that no later ``ray.init()`` on this machine tries to join the cluster that is gone)."""
    from ray._private.utils import get_ray_address_file, read_ray_address

    if read_ray_address() == address:
        os.remove(get_ray_address_file(None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=["clients", "nodes"], default=["clients", "nodes"])
    parser.add_argument("--clients", type=int, nargs="+", default=[10_000], help="federation sizes n, each against n = k")
    parser.add_argument("--cohort", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# {os.cpu_count()} CPUs, load average {psutil.getloadavg()[0]:.1f}; federated PCA Gr(40,4), clients of "
          "1,000 records, tau = 5, B = 50; median round of rounds 2..R", flush=True)
    if "clients" in args.sections:
        print("\n| run | round | peak RSS, all processes | memory | round x n = k |\n|---|---|---|---|---|", flush=True)
        clients_section(args.clients, args.cohort, args.rounds)
    if "nodes" in args.sections:
        print(f"\n| worker nodes | clients (all trained every round) | round | training | x 1 node | dropouts |\n"
              f"|---|---|---|---|---|---|", flush=True)
        nodes_section(args.nodes, args.rounds)


if __name__ == "__main__":
    main()
