"""Round time of the Ray engine and of the local engine, in the same run, at n = 10, 100, 500.

Federated PCA on Gr(40, 4) (1,000 records per client, tau = 5, B = 50), k = n/5 clients per round,
a fixed sigma and the exact accountant (its budget check, under a millisecond a round, is the same
on both engines). Every client is built once before the timed rounds (the local engine's
beforehand, the Ray engine's when their actors start, each also trained once, k at a time, untimed:
first-call costs); in the timed rounds both engines load the records of a sampled client that their
host let go (a host holds its latest round's clients only), and round 0 is left out. The Ray engine runs in the layout of ``rfedray run`` on
one machine (a Ray instance started for each measurement; the loop and the ledger in this
process, every client in a client actor), or with ``--cluster-layout`` in the layout on a
cluster (one Ray instance for the whole run; an accountant actor, every client in a client actor).
This process runs torch with as many threads
as each client actor (1 by default): with 2 threads on 2 busy cores, intra-op threads wait for
each other and the local engine measured 8x slower. Per engine and n it reports the median
round time (the loop's ``round_seconds``: charge, train, aggregate, evaluate), the median time of
the training step alone, their Ray/local ratios, and the peak memory: of this process for the local
engine, of this process and all its descendants (the driver and every Ray process it started) for
the Ray engine.

Run: ``python benchmarks/bench_engines.py [--sizes 10 100 500] [--rounds 6] [--threads 1] [--cluster-layout]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import psutil
import ray
import torch

from actors.engine import ray_executor
from actors.session import LOCAL_OBJECT_STORE_BYTES
from rfedray.config import load_config
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.setup import initial_params

GIB = 1024**3


def process_memory(descendants: bool) -> int:
    """RSS in bytes of this process, summed with all its descendants' if ``descendants``.

    The resident set size only (``/proc/PID/statm``, microseconds a process): the unique set size
    reads every mapping of ``/proc/PID/smaps``, tens of milliseconds for the processes of a Ray run,
    which sampled every half second in the driver took 4-6 ms from each of its 20 ms rounds.
    """
    total = 0
    me = psutil.Process()
    for proc in [me, *(me.children(recursive=True) if descendants else [])]:
        try:
            total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


class MemorySampler:
    """Samples :func:`process_memory` every ``interval`` seconds in a thread; keeps the peak."""

    def __init__(self, descendants: bool, interval: float = 0.5):
        self.descendants, self.interval, self.peak_rss = descendants, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, process_memory(self.descendants))
            self._stop.wait(self.interval)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class TimedExecutor:
    """Wraps an executor and records the seconds of every ``train`` call."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, []

    def train(self, cohort, theta, round_index, states):
        start = time.perf_counter()
        results = self.inner.train(cohort, theta, round_index, states)
        self.seconds.append(time.perf_counter() - start)
        return results

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # the rest of the executor (evaluation on the clients, aggregators)


def measure_engine(engine: str, n: int, k: int, rounds: int, output_dir: str, *overrides: str) -> dict:
    """Run federated PCA on ``engine`` and return its median round and train times and peak memory.

    The Ray engine uses the Ray instance of this process if it has one (the cluster layout), else it
    starts one for this run and shuts it down after (the one-machine layout of ``rfedray run``).
    """
    cfg = load_config(None, [
        f"run.engine={engine}", f"run.rounds={rounds}", f"run.output_dir={output_dir}", f"federation.n_clients={n}",
        f"federation.clients_per_round={k}", "federation.local_steps=5", "federation.batch_size=50",
        "data.options.d=40", "data.options.p=4", "data.options.records_per_client=1000", "privacy.sigma=0.5", "privacy.epsilon=null",
        "privacy.noise_seed=0", "monitoring.progress=false", "run.checkpoint_every=1000", *overrides,
    ])
    fed = Federation.prepare(cfg, RunDirectory.create(output_dir, f"{engine}-{n}-{time.time_ns()}"))
    with MemorySampler(descendants=engine == "ray") as memory:
        executor = ray_executor(fed) if engine == "ray" else fed.local_executor()
        if engine == "local":
            for cid in range(n):
                executor.client(cid)
        else:  # every client trained once, untimed, k at a time (first-call costs)
            theta = initial_params(cfg, fed.model)
            for first in range(0, n, k):
                executor.train(list(range(first, min(n, first + k))), theta, 0, {})
        timed = TimedExecutor(executor)
        try:
            fed.run(timed)
        finally:
            timed.close()
    records = [r for r in fed.run_dir.read_metrics() if "event" not in r][1:]
    return {
        "round_s": statistics.median(r["round_seconds"] for r in records),
        "train_s": statistics.median(timed.seconds[1:]),
        "failed": sum(r["failed"] for r in records),
        "peak_rss_gib": memory.peak_rss / GIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 500])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of this process (the local engine and the server side); client "
                             "actors use int(ray.num_cpus_per_actor) = 1")
    parser.add_argument("--ray-overrides", nargs="*", default=[], help="configuration overrides of the Ray engine's run")
    parser.add_argument("--cluster-layout", action="store_true",
                        help="one Ray instance for the run: an accountant actor, every client in a client actor")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.cluster_layout:
        ray.init(address="local", include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                 log_to_driver=False)
    cpus = psutil.cpu_count()
    layout = ("cluster layout: min(n, CPUs) client actors" if args.cluster_layout
              else "one-machine layout: the ledger here, min(n, CPUs) client actors")
    print(f"# {cpus} CPUs, load average {psutil.getloadavg()[0]:.1f}, {args.threads} torch thread(s) here; "
          f"Ray engine in the {layout} of 1 thread")
    print(f"{'n':>5} {'k':>4} {'local s':>9} {'ray s':>9} {'ratio':>6} {'train local':>12} {'train ray':>10} "
          f"{'ratio':>6} {'mem local':>10} {'mem ray':>8}  (median per round; memory: peak RSS GiB)")
    with tempfile.TemporaryDirectory() as out:
        for n in args.sizes:
            k = max(1, n // 5)
            local = measure_engine("local", n, k, args.rounds, out)
            remote = measure_engine("ray", n, k, args.rounds, out, *args.ray_overrides)
            dropouts = f"  ({remote['failed']} dropouts)" if remote["failed"] else ""
            print(f"{n:>5} {k:>4} {local['round_s']:>9.4f} {remote['round_s']:>9.4f} "
                  f"{remote['round_s'] / local['round_s']:>6.2f} {local['train_s']:>12.4f} {remote['train_s']:>10.4f} "
                  f"{remote['train_s'] / local['train_s']:>6.2f} {local['peak_rss_gib']:>10.2f} "
                  f"{remote['peak_rss_gib']:>8.2f}{dropouts}", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
