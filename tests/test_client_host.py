"""A client host keeps the records of its latest round's clients only, and what its clients keep."""

import torch

from rfedray.federated.engine import ClientHost
from rfedray.task import ClientData


class CountingDataset:
    """Four clients of two records each; counts the loads of every client."""

    num_clients, info = 4, {}

    def __init__(self):
        self.loads = [0] * self.num_clients

    def client_data(self, client_id):
        self.loads[client_id] += 1
        return ClientData((torch.full((2, 3), float(client_id)),))

    def client_sizes(self):
        return [2] * self.num_clients


def count_rounds(client, theta, round_index):
    client.state["rounds"] = client.state.get("rounds", 0) + 1
    return float(client.data.train[0].sum()), client.state["rounds"]


def test_a_host_holds_its_latest_rounds_clients_and_their_state_survives_a_reload():
    data = CountingDataset()
    host = ClientHost(data, model=None, client_ids=range(4))
    for cid in range(4):
        host.client(cid)  # the check at start: every client loaded once, none kept
    assert data.loads == [1, 1, 1, 1]
    assert host.run([0, 1], count_rounds, None, 0) == {0: (0.0, 1), 1: (6.0, 1)}
    assert host.run([0, 1], count_rounds, None, 1) == {0: (0.0, 2), 1: (6.0, 2)}
    assert data.loads == [2, 2, 1, 1]  # held from one round to the next
    host.run([2, 3], count_rounds, None, 2)
    assert host.run([0, 3], count_rounds, None, 3) == {0: (0.0, 3), 3: (18.0, 2)}
    assert data.loads == [3, 2, 2, 2]  # 0 was let go when round 2 sampled others: loaded again, state kept
    assert host.run_each([1], count_rounds, None, 4) == {1: (6.0, 3)}
    host.run([0, 3], count_rounds, None, 5)
    assert data.loads == [3, 3, 2, 2]  # run_each holds nothing and lets no held client go


def test_a_host_keeps_the_most_recently_used_clients_up_to_keep():
    data = CountingDataset()
    host = ClientHost(data, model=None, client_ids=range(4), keep=1)
    host.run([0], count_rounds, None, 0)
    host.run([1], count_rounds, None, 1)
    host.run([2], count_rounds, None, 2)  # 1 (the most recent other) stays, 0 is let go
    assert data.loads == [1, 1, 1, 0]
    host.run([1], count_rounds, None, 3)
    host.run([0], count_rounds, None, 4)
    assert data.loads == [2, 1, 1, 0]
    everything = ClientHost(CountingDataset(), model=None, client_ids=range(4), keep=4)
    for round_index, cohort in enumerate([[0, 1], [2, 3], [1, 2], [3, 0]]):
        everything.run(cohort, count_rounds, None, round_index)
    assert everything.dataset.loads == [1, 1, 1, 1]  # the local engine's: a client is loaded once
