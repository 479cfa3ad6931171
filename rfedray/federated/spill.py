"""The records of clients a host has let go, kept as raw bytes in one unnamed file of its process.

A client actor holds the records of its latest round's clients only
(:class:`~rfedray.federated.engine.ClientHost`), so that its memory is a cohort's records, not its
whole block's. A client sampled again after it was let go used to be loaded from its data source
again: regenerated from its seed (a synthetic PCA client of 1,000 x 40 records: 1.3 ms), read and
decoded from a file, preprocessed. With 10,000 clients and 100 sampled a round, those loads were
most of what a round took beyond one of n = k clients. :class:`SpilledDataset` loads each client
from the source once and writes its records to a :class:`SpillFile`; reading them back is one copy
from the operating system's page cache (tens of microseconds for 160 KB), and the process's resident
memory stays its latest round's.

The file is created unlinked (:func:`tempfile.TemporaryFile`: no name in any directory, mode 0600),
in the host's process, on the client's node: no other process can open it, and it is gone when the
process ends, however it ends. The records go nowhere they were not already (the process holds them
while it trains). The operating system keeps the file's pages in memory while memory allows and
writes them to the disk of ``$TMPDIR`` (a directory in RAM, such as a ``tmpfs``, keeps them in memory).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rfedray.task import ClientData

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Extent:
    """Where one tensor's bytes are in a :class:`SpillFile`, and what they were."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device


class SpillFile:
    """Clients' records as raw bytes in one unnamed temporary file, each written once and read back
    any number of times.

    Parameters
    ----------
    directory : str, optional
        Where the file is created (unlinked at once); ``$TMPDIR`` or the system's default when not
        given.
    """

    def __init__(self, directory: Optional[str] = None):
        self._file = tempfile.TemporaryFile(dir=directory)
        self._end = 0
        self._index: dict[int, tuple[tuple[Extent, ...], Optional[tuple[Extent, ...]]]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes written so far."""
        return self._end

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._index

    def put(self, client_id: int, data: ClientData) -> None:
        """Write the records of ``data`` (training records and test split), once per client.

        Raises
        ------
        OSError
            When the file cannot take them (a full disk): nothing of this client is then kept, and
            what was written before stays readable.
        """
        if client_id in self._index:
            return
        end = self._end
        try:
            train = tuple(self._write(t) for t in data.train)
            test = None if data.test is None else tuple(self._write(t) for t in data.test)
        except OSError:
            self._end = end  # the next client's bytes go over the partial ones
            raise
        self._index[client_id] = (train, test)

    def get(self, client_id: int) -> Optional[ClientData]:
        """The records written for ``client_id``, bit for bit, on their devices; None if none were."""
        entry = self._index.get(client_id)
        if entry is None:
            return None
        train, test = entry
        return ClientData(tuple(self._read(e) for e in train), None if test is None else tuple(self._read(e) for e in test))

    def close(self) -> None:
        self._file.close()
        self._index.clear()

    def _write(self, tensor: torch.Tensor) -> Extent:
        raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        view, offset = memoryview(raw), self._end
        while view:
            written = os.pwrite(self._file.fileno(), view, self._end)
            view, self._end = view[written:], self._end + written
        return Extent(offset, raw.nbytes, tensor.dtype, tuple(tensor.shape), tensor.device)

    def _read(self, extent: Extent) -> torch.Tensor:
        raw = torch.empty(extent.nbytes, dtype=torch.uint8)
        view, offset = memoryview(raw.numpy()), extent.offset
        while view:
            read = os.preadv(self._file.fileno(), [view], offset)
            if read == 0:
                raise OSError(f"the spill file ends at byte {offset}, before the {extent.nbytes} bytes written there")
            view, offset = view[read:], offset + read
        return raw.view(extent.dtype).reshape(extent.shape).to(extent.device)


class SpilledDataset:
    """A federated dataset that loads each client from ``dataset`` once and reads it back from a
    :class:`SpillFile` afterwards (the same records, bit for bit).

    A client whose records the file cannot take (a full disk: logged once, and no client is written
    after it) or give back (a failed read: logged) is loaded from ``dataset``, as without a spill file.

    Parameters
    ----------
    dataset : FederatedDataset
    spill : SpillFile, optional
        A new one in ``$TMPDIR`` when not given.
    """

    def __init__(self, dataset: Any, spill: Optional[SpillFile] = None):
        self.dataset = dataset
        self.spill = SpillFile() if spill is None else spill
        self.num_clients, self.info = dataset.num_clients, dataset.info
        self._full = False

    def client_sizes(self) -> list[int]:
        return self.dataset.client_sizes()

    def client_data(self, client_id: int) -> ClientData:
        try:
            data = self.spill.get(client_id)
        except OSError as exc:  # a disk that fails a read: the source still has the records
            log.warning("client %d: reading its records back from the spill file failed (%s); loading them from the "
                        "source", client_id, exc)
            data = None
        if data is not None:
            return data
        data = self.dataset.client_data(client_id)
        if not self._full:
            try:
                self.spill.put(client_id, data)
            except OSError as exc:  # records are loaded from the source again; the run goes on
                self._full = True
                log.warning("the spill file (%s) takes no more clients' records after %d bytes: %s; clients let go "
                            "are loaded from their source again", tempfile.gettempdir(), self.spill.nbytes, exc)
        return data

    def close(self) -> None:
        self.spill.close()
