"""A client host keeps the records of its latest round's clients only, and what its clients keep; the
clients it lets go are read back from its spill file, bit for bit, not loaded from the source again."""

import os

import torch

from rfedray.federated.engine import ClientHost
from rfedray.federated.spill import SpilledDataset, SpillFile
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
    host.load(range(4))  # the check at start: every client loaded once, none held
    assert data.loads == [1, 1, 1, 1] and not host._held
    assert host.run([0, 1], count_rounds, None, 0) == {0: (0.0, 1), 1: (6.0, 1)}
    assert host.run([0, 1], count_rounds, None, 1) == {0: (0.0, 2), 1: (6.0, 2)}
    assert list(host._held) == [0, 1]  # held from one round to the next
    host.run([2, 3], count_rounds, None, 2)
    assert list(host._held) == [2, 3]
    assert host.run([0, 3], count_rounds, None, 3) == {0: (0.0, 3), 3: (18.0, 2)}  # 0 read back, its state kept
    assert host.run_each([1], count_rounds, None, 4) == {1: (6.0, 3)}
    assert list(host._held) == [0, 3]  # run_each holds nothing and lets no held client go
    assert data.loads == [1, 1, 1, 1]  # every later load came from the spill file
    assert host.dataset.spill.nbytes == 4 * 2 * 3 * 4


def test_a_host_keeps_the_most_recently_used_clients_up_to_keep():
    data = CountingDataset()
    host = ClientHost(data, model=None, client_ids=range(4), keep=1)
    host.run([0], count_rounds, None, 0)
    host.run([1], count_rounds, None, 1)
    host.run([2], count_rounds, None, 2)  # 1 (the most recent other) stays, 0 is let go
    assert list(host._held) == [1, 2]
    host.run([1], count_rounds, None, 3)
    host.run([0], count_rounds, None, 4)
    assert list(host._held) == [1, 0] and data.loads == [1, 1, 1, 0]
    everything = ClientHost(CountingDataset(), model=None, client_ids=range(4), keep=4)
    everything.load(range(4))  # the local engine's check at start holds what it loads
    for round_index, cohort in enumerate([[0, 1], [2, 3], [1, 2], [3, 0]]):
        everything.run(cohort, count_rounds, None, round_index)
    assert everything.dataset.loads == [1, 1, 1, 1]  # the local engine's: a client is loaded once, no spill file


def test_the_spill_file_gives_back_every_dtype_shape_and_test_split_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(0)
    clients = {
        0: ClientData((torch.randn(5, 3, generator=g), torch.randint(0, 4, (5,), generator=g)),
                      (torch.randn(2, 3, dtype=torch.float64, generator=g), torch.tensor([True, False]))),
        1: ClientData((torch.randn(4, 2, 2, generator=g).to(torch.bfloat16).transpose(1, 2),)),  # not contiguous
        2: ClientData((torch.empty(0, 7), torch.tensor(3.5))),  # no records, a 0-d tensor
    }
    spill = SpillFile(str(tmp_path))
    for cid, data in clients.items():
        spill.put(cid, data)
    for cid, data in reversed(clients.items()):
        back = spill.get(cid)
        for mine, theirs in zip((*data.train, *(data.test or ())), (*back.train, *(back.test or ()))):
            assert theirs.dtype == mine.dtype and theirs.shape == mine.shape and torch.equal(theirs, mine)
        assert (back.test is None) == (data.test is None)
    assert spill.get(3) is None
    assert os.listdir(tmp_path) == []  # the file has no name: no other process can open it
    spill.close()


def test_a_full_or_failing_disk_leaves_the_clients_loaded_from_the_source(monkeypatch):
    data = CountingDataset()
    spilled = SpilledDataset(data)
    assert torch.equal(spilled.client_data(0).train[0], torch.zeros(2, 3))
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, b, off: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    assert torch.equal(spilled.client_data(1).train[0], torch.ones(2, 3))
    assert torch.equal(spilled.client_data(1).train[0], torch.ones(2, 3))
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert torch.equal(spilled.client_data(0).train[0], torch.zeros(2, 3))
    assert data.loads == [1, 2, 0, 0]  # 0 from the file; 1 from the source each time; no write tried after the first failure
    assert 1 not in spilled.spill and spilled.spill.nbytes == 24
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    assert torch.equal(spilled.client_data(0).train[0], torch.zeros(2, 3))
    assert data.loads == [2, 2, 0, 0]  # a failed read: from the source
