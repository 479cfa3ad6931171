"""The secure-aggregation actors of DDP-SA and of the clients' test evaluation
(:mod:`rfedray.federated.evaluation`): S :class:`~rfedray.ddpsa.secure_aggregation.ShareAggregator`
actors, each receiving one share of every client's update (see :mod:`rfedray.ddpsa.secure_aggregation`;
:class:`~rfedray.ddpsa.secure_aggregation.LocalAggregators` is the same group in one process).
"""

from __future__ import annotations

import ray

from rfedray.ddpsa.secure_aggregation import ShareAggregator


class RayAggregators:
    """S aggregator actors (the Ray engine); the handle is picklable, so client actors send directly.

    Parameters
    ----------
    num_aggregators : int
    min_clients : int
    """

    def __init__(self, num_aggregators: int, min_clients: int = 2):
        if num_aggregators < 2:
            raise ValueError(f"num_aggregators={num_aggregators}: must be >= 2")
        remote_cls = ray.remote(num_cpus=0)(ShareAggregator)
        self.num_aggregators = num_aggregators
        self.actors = [remote_cls.remote(j, min_clients) for j in range(num_aggregators)]

    def send(self, index, round_index, client_id, share):
        ray.get(self.actors[index].receive.remote(round_index, client_id, share))

    def received(self, round_index):
        return ray.get([a.received.remote(round_index) for a in self.actors])

    def partial_sums(self, round_index, client_ids):
        return ray.get([a.partial_sum.remote(round_index, list(client_ids)) for a in self.actors])

    def discard(self, round_index):
        ray.get([a.discard.remote(round_index) for a in self.actors])

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a)
