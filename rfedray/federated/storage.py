"""Where a run directory lives: a folder of this machine, or object storage (``s3://``, ``gs://``, ...).

Two stores with one interface (:class:`Store`); :func:`open_store` picks one from ``run.output_dir``
or a ``--resume`` argument:

* :class:`LocalStore`: a plain path or a ``file://`` URL (a shared mount, NFS, counts: it is a
  folder to this machine). A file is replaced atomically (temporary file, fsync, rename, fsync of
  the folder), a line is appended and fsynced, the writer lock is a ``flock`` on the folder, and
  ``.reserve`` keeps space for the last checkpoint;
* :class:`ObjectStore`: any other URL, through fsspec (``s3://`` with s3fs, ``gs://`` with gcsfs).
  An object is replaced by one PUT, which object stores make atomic (a reader sees the old or the
  new bytes, never a part); an append rewrites the object (one writer holds the lock, so no update
  is lost); the writer lock is an object created only if absent (S3's ``If-None-Match: *``) and
  refreshed by a heartbeat, stale when the heartbeat is older than :data:`LEASE_S`.

Write-ahead holds on both: a charge is persisted (fsync, or the PUT's answer) before the round's
cohort trains. Credentials and endpoints of object storage come from the environment as usual
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ... for S3), on the driver and on the node that runs
the Ray server actor.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Optional

from rfedray.errors import RfedrayError

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
LOCK = ".lock"
TEMPORARY = ".tmp"  # the suffix of atomic_write_bytes' temporary files
RESERVE = ".reserve"
LEASE_S = 60.0
"""An object-storage lock whose heartbeat is older than this is stale (its holder died)."""
HEARTBEAT_S = 10.0


class RunDirectoryWriteError(RfedrayError):
    """A file of the run directory could not be written (disk full, permission, read-only).

    The file's previous version is intact and the temporary file is removed. Exit status 1: the
    input was fine, the environment failed; ``rfedray run --resume RUN_DIR`` continues the run.

    Attributes
    ----------
    problem : str
        What failed (``cannot write PATH (reason)``).
    remedy : str
        What the user does about it (``free space``, ``make it writable``).
    out_of_space : bool
        Whether the storage was full (then the run's reserved space may help).
    """

    exit_code = 1
    problem, remedy, out_of_space = "", "", False


class RunDirectoryBusyError(RfedrayError):
    """Another process holds the run directory's lock."""


def write_problem(where: str, exc: BaseException, run_dir: str) -> RunDirectoryWriteError:
    reason = getattr(exc, "strerror", None) or f"{type(exc).__name__}: {exc}"
    full = getattr(exc, "errno", None) in OUT_OF_SPACE
    remedy = "free space" if full else "make it writable"
    error = RunDirectoryWriteError(
        f"cannot write {where} ({reason}); the previous checkpoint and the budget ledger in {run_dir} are intact: "
        f"{remedy} and continue with rfedray run --resume {run_dir}"
    )
    error.problem, error.remedy, error.out_of_space = f"cannot write {where} ({reason})", remedy, full
    return error


def describe_holder(info: dict) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, started {when}"


def _holder_record(command: str, token: str) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "command": command,
            "token": token, "released": False}


class RunLock(ABC):
    """One writer per run directory (:class:`LocalLock`, :class:`ObjectLock`); a context manager:
    leaving the block releases it.

    Attributes
    ----------
    previous : dict
        What ``.lock`` said of the last holder when this one took the lock.
    """

    previous: dict

    @abstractmethod
    def announce(self, command: str) -> str:
        """Record this holder in ``.lock`` (host, pid, start time, a fresh token); return the token."""

    @abstractmethod
    def previous_holder_died(self) -> bool:
        """Whether the last holder ended without releasing the lock."""

    @abstractmethod
    def release(self) -> None: ...

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Store:
    """The files of one run directory, by name (:class:`LocalStore`, :class:`ObjectStore`).

    Each store has ``where(name)`` (the file's path or URL), ``read_bytes``, ``exists``, ``is_file``,
    ``size``, ``write_atomic`` (the old bytes or the new, never a part), ``append`` (a whole line or
    nothing), ``remove_all`` and ``lock`` (a :class:`RunLock`). Only a disk keeps ``.reserve``
    (:class:`LocalStore`): object storage does not fill up like one, so by default nothing is
    reserved and the store is never out of space.
    """

    location: str | Path

    def lock_record(self) -> dict:
        """What ``.lock`` says about the run directory's last announced holder; ``{}`` when nothing readable."""
        try:
            info = json.loads(self.read_bytes(LOCK))
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def reserve(self, nbytes: int) -> bool:
        return True

    def release_reserve(self) -> bool:
        return False

    def out_of_space(self) -> bool:
        return False

    def drop_reserve(self) -> None:
        pass


# ----- a folder of this machine ---------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` all at once: a temporary file, fsync, rename, fsync of the folder.

    Raises
    ------
    OSError
        When a step fails; ``path`` keeps its previous bytes and the temporary file is removed
        where the folder still allows it (a folder that turned read-only keeps it until the
        next lock holder's :func:`remove_temporaries`).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMPORARY}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            tmp.unlink(missing_ok=True)
        raise


def remove_temporaries(folder: Path) -> None:
    """Remove what interrupted :func:`atomic_write_bytes` calls left in ``folder`` (never read)."""
    for leftover in Path(folder).glob(f".*{TEMPORARY}"):
        leftover.unlink(missing_ok=True)


def _flock_holder_pid(path: Path) -> Optional[int]:
    """The pid that holds a ``flock`` on ``path``, from ``/proc/locks`` (None when not found there)."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode and fields[4].isdigit():
            return int(fields[4])
    return None


def _process_start(pid: int) -> Optional[float]:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # the process ended, or psutil cannot tell
        return None


class LocalLock(RunLock):
    """An exclusive ``flock`` on the run directory itself, held by the driver.

    The kernel releases it when its holder exits, however it exits (a killed driver included), so
    it is never stale. Taking it writes nothing: a refused or failing command leaves the run
    directory as it was. :meth:`announce` records the holder in ``.lock`` (host, pid, start time,
    a fresh token, ``released: false``) once the run is checked and about to write.
    """

    def __init__(self, store: "LocalStore"):
        self.store = store
        self.fd: Optional[int] = None
        self.token = ""
        self.previous: dict = {}

    def acquire(self) -> "LocalLock":
        """Take the lock or refuse, naming the holder (host, pid, start time).

        Raises
        ------
        RunDirectoryBusyError
        """
        root = self.store.root
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise RfedrayError(f"{root}: cannot open the run directory ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirectoryBusyError(
                f"{root}: another rfedray process is writing this run directory ({describe_holder(self.holder())}); "
                "wait for it to end or stop it, then run the command again"
            ) from None
        self.fd = fd
        self.previous = self.store.lock_record()
        return self

    def holder(self) -> dict:
        """Who holds the lock now: this host's ``/proc/locks`` names the pid, ``.lock`` the rest."""
        pid = _flock_holder_pid(self.store.root)
        info = self.store.lock_record()
        if pid is not None and info.get("pid") != pid:
            info = {"host": socket.gethostname(), "pid": pid, "started": _process_start(pid)}
        return info

    def announce(self, command: str) -> str:
        remove_temporaries(self.store.root)  # the lock is held: no other writer's file is in flight
        self.token = secrets.token_hex(8)
        self.store.write_atomic(LOCK, (json.dumps(_holder_record(command, self.token), sort_keys=True) + "\n").encode())
        return self.token

    def previous_holder_died(self) -> bool:
        return self.previous.get("released") is False

    def release(self) -> None:
        """Mark ``.lock`` released (best effort: a full disk must not hide the run's own error) and unlock."""
        if self.fd is None:
            return
        if self.token:
            try:
                record = dict(self.store.lock_record(), released=True)
                self.store.write_atomic(LOCK, (json.dumps(record, sort_keys=True) + "\n").encode())
            except RfedrayError:
                pass
        os.close(self.fd)  # closing the descriptor releases the flock
        self.fd = None


class LocalStore(Store):
    """A run directory in a folder of this machine (a shared mount included).

    Parameters
    ----------
    root : Path
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.location: str | Path = self.root

    def where(self, name: str) -> Path:
        return self.root / name

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def exists(self, name: str) -> bool:
        return (self.root / name).exists()

    def is_file(self, name: str) -> bool:
        return (self.root / name).is_file()

    def size(self, name: str) -> int:
        return (self.root / name).stat().st_size

    def write_atomic(self, name: str, data: bytes) -> None:
        try:
            atomic_write_bytes(self.root / name, data)
        except OSError as exc:
            raise write_problem(str(self.root / name), exc, str(self.root)) from None

    def append(self, name: str, line: bytes) -> None:
        try:
            with open(self.root / name, "ab") as fh:
                size = fh.tell()
                try:
                    fh.write(line)
                    fh.flush()
                    os.fsync(fh.fileno())
                except OSError:
                    fh.truncate(size)
                    raise
        except OSError as exc:
            raise write_problem(str(self.root / name), exc, str(self.root)) from None

    def remove_all(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def lock(self) -> LocalLock:
        return LocalLock(self).acquire()

    # ----- space for the last checkpoint ---------------------------------------------------------

    def reserve(self, nbytes: int) -> bool:
        """Keep ``nbytes`` allocated in ``.reserve``; False (and no reserve) when the disk has not that much free."""
        path = self.root / RESERVE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(fd, 0, max(1, int(nbytes)))
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno in OUT_OF_SPACE:
                self.release_reserve()
                return False
            raise write_problem(str(path), exc, str(self.root)) from None
        return True

    def release_reserve(self) -> bool:
        """Empty ``.reserve`` (its inode stays, as the mark of a full disk); False when nothing was reserved."""
        path = self.root / RESERVE
        try:
            if path.stat().st_size == 0:
                return False
            os.truncate(path, 0)
        except FileNotFoundError:
            return False
        return True

    def out_of_space(self) -> bool:
        try:
            return (self.root / RESERVE).stat().st_size == 0
        except FileNotFoundError:
            return False

    def drop_reserve(self) -> None:
        (self.root / RESERVE).unlink(missing_ok=True)


# ----- object storage -------------------------------------------------------------------------

class ObjectLock(RunLock):
    """A lock object created only if absent, with a heartbeat; stale after :data:`LEASE_S` without one.

    Parameters
    ----------
    store : ObjectStore
    """

    def __init__(self, store: "ObjectStore"):
        self.store = store
        self.token = ""
        self.previous: dict = {}
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None

    def acquire(self) -> "ObjectLock":
        """Create the lock object, taking over one whose heartbeat stopped; refuse a live holder.

        Raises
        ------
        RunDirectoryBusyError
        """
        for _ in range(3):
            record = {**_holder_record("starting", ""), "heartbeat": time.time()}
            try:
                self.store.create(LOCK, (json.dumps(record, sort_keys=True) + "\n").encode())
                return self
            except FileExistsError:
                pass
            holder = self.store.lock_record()
            if holder and time.time() - float(holder.get("heartbeat", 0)) < LEASE_S:
                raise RunDirectoryBusyError(
                    f"{self.store.location}: another rfedray process is writing this run directory "
                    f"({describe_holder(holder)}); wait for it to end or stop it, then run the command again"
                )
            self.previous = holder  # its heartbeat stopped: the holder died without releasing
            self.store.remove(LOCK)
        raise RunDirectoryBusyError(f"{self.store.location}: could not take the run directory's lock; try again")

    def _record(self, command: str) -> bytes:
        return (json.dumps({**_holder_record(command, self.token), "heartbeat": time.time()}, sort_keys=True) + "\n").encode()

    def announce(self, command: str) -> str:
        self.token = secrets.token_hex(8)
        self.store.write_atomic(LOCK, self._record(command))
        self._beat = threading.Thread(target=self._heartbeat, args=(command,), daemon=True, name="rfedray-lock-heartbeat")
        self._beat.start()
        return self.token

    def _heartbeat(self, command: str) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self.store.lock_record().get("token") != self.token:
                    return
                self.store.write_atomic(LOCK, self._record(command))
            except Exception:  # a missed beat is retried; a lost lock shows at the next write
                pass

    def previous_holder_died(self) -> bool:
        return bool(self.previous)

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=HEARTBEAT_S)
        try:
            if self.store.lock_record().get("token", "") == self.token:
                self.store.remove(LOCK)
        except Exception:  # best effort: the lease runs out by itself
            pass


class ObjectStore(Store):
    """A run directory in object storage, through fsspec (``s3://bucket/runs/ID``, ``gs://...``).

    Parameters
    ----------
    url : str
    """

    def __init__(self, url: str):
        import fsspec

        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise RfedrayError(f"{url}: no storage for this URL ({exc}); for s3:// install s3fs, for gs:// gcsfs") from None
        self.location: str | Path = url.rstrip("/")

    def where(self, name: str) -> str:
        return f"{self.location}/{name}"

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def read_bytes(self, name: str) -> bytes:
        return self.fs.cat_file(self._key(name))

    def exists(self, name: str) -> bool:
        return self.fs.exists(self._key(name))

    def is_file(self, name: str) -> bool:
        return self.fs.isfile(self._key(name))

    def size(self, name: str) -> int:
        return self.fs.size(self._key(name))

    def write_atomic(self, name: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self._key(name), data)
        except Exception as exc:  # the storage client's own errors (HTTP, credentials, ...)
            raise write_problem(self.where(name), exc, str(self.location)) from None

    def create(self, name: str, data: bytes) -> None:
        """Write ``name`` only if it does not exist yet.

        Raises
        ------
        FileExistsError
        """
        with self.fs.open(self._key(name), "xb") as fh:
            fh.write(data)

    def append(self, name: str, line: bytes) -> None:
        try:
            old = self.read_bytes(name)
        except FileNotFoundError:
            old = b""
        self.write_atomic(name, old + line)

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(self._key(name))
        except FileNotFoundError:
            pass

    def remove_all(self) -> None:
        try:
            self.fs.rm(self.root, recursive=True)
        except FileNotFoundError:
            pass

    def lock(self) -> ObjectLock:
        return ObjectLock(self).acquire()


def local_path(location: str | os.PathLike) -> Optional[Path]:
    """The folder of a path or ``file://`` URL; None for an object-storage URL."""
    text = os.fspath(location)
    if text.startswith("file://"):
        return Path(text[len("file://"):])
    return None if "://" in text else Path(text)


def open_store(location: str | os.PathLike) -> Store:
    """The store of ``location``: a path or ``file://`` URL is a local folder, another URL object storage."""
    folder = local_path(location)
    return ObjectStore(os.fspath(location)) if folder is None else LocalStore(folder)
