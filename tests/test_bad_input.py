"""Bad input, a clear error, nothing lost.

Every case is a command line that must fail before anything trains: exit status 2 and one line
``error: ...`` on stderr that names what is wrong and where (the field, the file, the array, the
record) and says what to do, never a traceback. A previous run directory next to it (and, for
``--resume``, the run directory being resumed) must be byte-identical afterwards.

Cases run through :func:`rfedray.cli.main` in this process (the CLI's own error handling); the
ones with ``subprocess=True`` run as a real ``python -m rfedray.cli`` instead, whose whole stderr
must be that one line (logging included).
"""

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from rfedray.cli import main
from rfedray.config import load_config
from rfedray.errors import RfedrayError
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["--quiet", "monitoring.progress=false"]
LOCAL = "run.engine=local"
SYNTHETIC = [
    LOCAL, "run.rounds=4", "run.checkpoint_every=2", "federation.n_clients=3", "federation.clients_per_round=2",
    "federation.local_steps=2", "federation.batch_size=10", "data.options.d=6", "data.options.p=2",
    "data.options.records_per_client=40", "privacy.sigma=0.5", "privacy.epsilon=null",
]
ARRAYS = [
    LOCAL, "run.rounds=2", "federation.n_clients=3", "federation.clients_per_round=2", "federation.local_steps=2",
    "federation.batch_size=10", "privacy.sigma=0.5", "privacy.epsilon=null", "data.source=arrays",
]


def snapshot(path: Path) -> dict[str, str]:
    """Every file under ``path`` and the SHA-256 of its bytes."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- data files -------------------------------------------------------------------------------

def vector_arrays(rng, clients=3, m=40, d=6):
    arrays = {f"x_{i}": rng.standard_normal((m, d)) for i in range(clients)}
    arrays["x_test"] = rng.standard_normal((30, d))
    return arrays


def spd(rng, n, c=4):
    a = rng.standard_normal((n, c, c))
    return a @ np.swapaxes(a, -1, -2) / c + 0.5 * np.eye(c)


def covariance_arrays(rng, clients=3, m=20, c=4):
    arrays = {f"x_{i}": spd(rng, m, c) for i in range(clients)}
    arrays.update({f"y_{i}": np.arange(m) % 2 for i in range(clients)})
    arrays["x_test"], arrays["y_test"] = spd(rng, 10, c), np.arange(10) % 2
    return arrays


def labelled_arrays(rng):
    arrays = vector_arrays(rng)
    arrays.update({f"y_{i}": np.arange(40) % 2 for i in range(3)})
    arrays["y_test"] = np.arange(30) % 2
    return arrays


def npz(tmp: Path, make, edit: Callable[[dict], None] = lambda a: None, name="clients.npz") -> str:
    arrays = make(np.random.default_rng(0))
    edit(arrays)
    path = tmp / name
    np.savez(path, **arrays)
    return str(path)


def set_entry(key, index, value):
    def edit(arrays):
        arrays[key] = arrays[key].astype(np.result_type(arrays[key], type(value)))
        arrays[key][index] = value
    return edit


def replace(key, value):
    def edit(arrays):
        arrays[key] = value(arrays[key]) if callable(value) else value
    return edit


def drop(key):
    return lambda arrays: arrays.pop(key)


def vector_run(tmp, edit=lambda a: None, *extra):
    return ["run", *ARRAYS, f"data.options.path={npz(tmp, vector_arrays, edit)}", "data.options.p=2", *extra]


def labelled_run(tmp, edit=lambda a: None, *extra):
    return ["run", *ARRAYS, f"data.options.path={npz(tmp, labelled_arrays, edit)}", "data.options.task=classification",
            "model.name=logreg", *extra]


def spd_run(tmp, edit=lambda a: None, *extra):
    return ["run", *ARRAYS, f"data.options.path={npz(tmp, covariance_arrays, edit)}", "data.options.task=classification",
            "data.options.representation=covariance", "model.name=spdnet", "model.options.d=2", *extra]


def eeg_cache_run(tmp, edit):
    """A MOABB (PhysionetMI) run whose subject 1 comes from a cache file written here."""
    from rfedray.data.eeg import MOABBEEG, Options

    options = Options(subjects=[1], cache_dir=str(tmp / "cache"))
    cache = MOABBEEG(options, n_clients=1, seed=0).cache
    rng = np.random.default_rng(0)
    x, y = spd(rng, 20, 64), np.arange(20) % 2
    edit(x)
    cache.save(1, x, y)
    return ["run", LOCAL, "run.rounds=2", "federation.n_clients=1", "federation.clients_per_round=1", "federation.local_steps=1",
            "federation.batch_size=5", "privacy.sigma=0.5", "privacy.epsilon=null", "data.source=moabb",
            "data.options.subjects=[1]", f"data.options.cache_dir={tmp / 'cache'}", "model.name=spdnet", "model.options.d=4"]


def eeg_trial(edit_trial):
    def edit(x):
        x[3] = edit_trial(x[3])
    return edit


def yaml_bytes(tmp, data: bytes):
    path = tmp / "bad.yaml"
    path.write_bytes(data)
    return str(path)


def yaml_file(tmp, text):
    path = tmp / "bad.yaml"
    path.write_text(text)
    return str(path)


# ----- cases ------------------------------------------------------------------------------------

@dataclass
class Case:
    """A failing command: ``argv(context)`` gives the arguments, ``expect`` fragments of the error line.

    ``resume`` cases resume ``context.run_dir``, a copy of a finished run that ``damage`` may change
    first; the copy must be byte-identical after the failure.
    """

    name: str
    argv: Callable
    expect: tuple[str, ...]
    resume: bool = False
    damage: Callable[[Path], None] = lambda run_dir: None
    subprocess: bool = False


def resume(*overrides):
    return lambda c: ["run", "--resume", str(c.run_dir), *overrides]


def write(name, data: bytes):
    return lambda run_dir: (run_dir / name).write_bytes(data)


def edit_checkpoint(change):
    def damage(run_dir):
        state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
        torch.save(change(state), run_dir / "checkpoint.pt")
    return damage


def nan_theta(state):
    state["theta"] = {k: torch.full_like(v, float("nan")) for k, v in state["theta"].items()}
    return state


def other_budget(run_dir):
    text = (run_dir / "budget.json").read_text()
    (run_dir / "budget.json").write_text(text.replace('"sigma": 0.5', '"sigma": 0.25'))


def corrupt_metrics_line(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][: len(lines[1]) // 2]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


class BusyPort:
    """A port with a listening socket on it, for the length of one case."""

    def __enter__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        return self.sock.getsockname()[1]

    def __exit__(self, *exc):
        self.sock.close()


def under_a_file(tmp):
    (tmp / "plain").write_text("x")
    return tmp / "plain" / "runs"


CASES = [
    # configuration
    Case("cohort-larger-than-population", lambda c: ["run", *SYNTHETIC, "federation.clients_per_round=60"],
         ("federation.clients_per_round=60", "between 1 and federation.n_clients (3)")),
    Case("delta-out-of-range", lambda c: ["run", "privacy.delta=2"], ("privacy.delta=2", "open interval (0, 1)")),
    Case("clip-nan", lambda c: ["run", "privacy.clip=nan"], ("privacy.clip=nan", "finite number > 0")),
    Case("sigma-infinite", lambda c: ["run", "privacy.sigma=inf"], ("privacy.sigma=inf", "finite number > 0")),
    Case("batch-zero", lambda c: ["run", "federation.batch_size=0"], ("federation.batch_size=0", ">= 1")),
    Case("rounds-not-a-number", lambda c: ["run", "run.rounds=abc"], ("run.rounds='abc'", "Integer")),
    Case("unknown-key", lambda c: ["run", "federation.n_clent=3"], ("federation.n_clent=3", "did you mean 'federation.n_clients'")),
    Case("config-file-missing", lambda c: ["run", str(c.tmp / "nope.yaml")], ("config=", "not found")),
    Case("config-yaml-syntax", lambda c: ["run", yaml_file(c.tmp, "run: {rounds: 3\n")], ("config=", "YAML syntax error at line")),
    Case("config-not-a-mapping", lambda c: ["run", yaml_file(c.tmp, "- 1\n- 2\n")], ("config=", "YAML mapping")),
    Case("unknown-manifold", lambda c: ["run", "model.options.manifold=hyperbolic"], ("model.options.manifold='hyperbolic'", "grassmann")),
    Case("unknown-data-source", lambda c: ["run", "data.source=nope"], ("data.source='nope'", "arrays")),
    Case("metrics-port-out-of-range", lambda c: ["run", "monitoring.metrics_port=70000"], ("monitoring.metrics_port=70000", "[0, 65535]")),
    Case("learning-rate-zero", lambda c: ["run", "optim.default.lr=0"], ("optim.default.lr=0", "> 0")),
    Case("pca-rank-too-large", lambda c: ["run", "data.options.d=4", "data.options.p=4"], ("data.options.p=4", "between 1 and d-1")),
    Case("config-not-utf8", lambda c: ["run", yaml_bytes(c.tmp, b"run:\n  name: caf\xe9\n")],
         ("config=", "is not UTF-8 text (byte 0xe9 at offset 16)", "save it as UTF-8")),
    Case("override-not-utf8", lambda c: ["run", *SYNTHETIC, "run.name=caf\udce9"],
         ("override=b'run.name=caf\\xe9'", "is not UTF-8 text"), subprocess=True),
    Case("seed-too-large", lambda c: ["run", *SYNTHETIC, "run.seed=99999999999999999999"],
         ("run.seed=99999999999999999999", "must be an integer in [0, 4294967295]")),
    Case("run-name-escapes-output-dir", lambda c: ["run", *SYNTHETIC, "run.name=../x"],
         ("run.name='../x'", "plain name", "inside run.output_dir")),
    Case("dimension-beyond-memory", lambda c: ["run", *SYNTHETIC, "data.options.d=100000"],
         ("data.options.d=100000", "GiB of memory", "lower data.options.d")),
    Case("too-many-clients", lambda c: ["run", *SYNTHETIC, "federation.n_clients=10000000"],
         ("federation.n_clients=10000000", "must be at most 100000")),
    Case("records-beyond-memory", lambda c: ["run", *SYNTHETIC, "federation.n_clients=100000",
                                             "data.options.records_per_client=1000000"],
         ("federation.n_clients=100000", "GiB of memory", "lower federation.n_clients")),
    # data: the arrays source
    Case("nan-record", lambda c: vector_run(c.tmp, set_entry("x_1", (3, 2), np.nan)),
         ("data.options.path=", "x_1 (client 1): record 3 is not finite (nan)", "repair or remove")),
    Case("infinite-record", lambda c: vector_run(c.tmp, set_entry("x_2", (0, 0), np.inf)),
         ("x_2 (client 2): record 0 is not finite (inf)",)),
    Case("nan-test-record", lambda c: vector_run(c.tmp, set_entry("x_test", (5, 1), np.nan)),
         ("x_test (the server's evaluation set): record 5 is not finite",)),
    Case("test-record-overflows-training-dtype", lambda c: vector_run(c.tmp, set_entry("x_test", (4, 0), 1e300)),
         ("x_test (the server's evaluation set): record 4 is not finite (inf) as float32", "data.options.dtype")),
    Case("client-record-overflows-training-dtype", lambda c: vector_run(c.tmp, set_entry("x_1", (7, 3), -1e300)),
         ("x_1 (client 1): record 7 is not finite (inf) as float32",)),
    Case("client-key-with-leading-zero", lambda c: vector_run(c.tmp, lambda a: a.update(x_01=a["x_1"][:20])),
         ("array 'x_01'", "without leading zeros (x_1)")),
    Case("empty-client", lambda c: vector_run(c.tmp, replace("x_1", lambda x: x[:0])), ("x_1 has no records", "lower federation.n_clients")),
    Case("client-smaller-than-batch", lambda c: vector_run(c.tmp, replace("x_2", lambda x: x[:5])),
         ("federation.batch_size=10", "smallest client's record count (5, client 2)")),
    Case("fewer-clients-than-configured", lambda c: vector_run(c.tmp, drop("x_2")),
         ("federation.n_clients=3", "holds clients [0, 1]", "set federation.n_clients=2")),
    Case("client-index-gap", lambda c: vector_run(c.tmp, lambda a: a.update(x_5=a.pop("x_2"))),
         ("federation.n_clients=3", "holds clients [0, 1, 5]")),
    Case("record-dimension-differs", lambda c: vector_run(c.tmp, replace("x_1", lambda x: x[:, :5])),
         ("x_1 holds records of shape (5,), x_0 of shape (6,)",)),
    Case("records-of-wrong-rank", lambda c: vector_run(c.tmp, replace("x_0", lambda x: x.reshape(40, 2, 3))),
         ("x_0 has shape (40, 2, 3)", "representation=vector expects (m, d)")),
    Case("complex-records", lambda c: vector_run(c.tmp, replace("x_0", lambda x: x.astype(np.complex128))),
         ("x_0 has dtype complex128", "real numbers")),
    Case("string-records", lambda c: vector_run(c.tmp, replace("x_1", lambda x: x.astype(str))), ("x_1 has dtype <U",)),
    Case("pickled-object-array", lambda c: vector_run(c.tmp, replace("x_0", lambda x: np.array([object()] * 40))),
         ("array 'x_0' cannot be read", "no Python objects")),
    Case("not-an-npz-file", lambda c: ["run", *ARRAYS, f"data.options.path={yaml_file(c.tmp, 'hello')}"],
         ("not a readable .npz file", "numpy.savez")),
    Case("single-npy-array", lambda c: ["run", *ARRAYS, f"data.options.path={save_npy(c.tmp)}"], ("holds a single array",)),
    Case("arrays-file-missing", lambda c: ["run", *ARRAYS, f"data.options.path={c.tmp / 'missing.npz'}"],
         ("data.options.path=", "no such file")),
    Case("unexpected-array", lambda c: vector_run(c.tmp, lambda a: a.update(weights=np.ones(3))), ("unexpected array 'weights'",)),
    Case("labels-given-for-pca", lambda c: vector_run(c.tmp, lambda a: a.update(y_0=np.zeros(40, dtype=int))),
         ("holds y_0, but data.options.task=pca takes no labels",)),
    Case("missing-test-set", lambda c: vector_run(c.tmp, drop("x_test")), ("has no array 'x_test'",)),
    Case("label-out-of-range", lambda c: labelled_run(c.tmp, set_entry("y_1", 4, 5), "data.options.num_classes=2"),
         ("y_1: record 4 has a label outside [0, 2)", "data.options.num_classes")),
    Case("negative-label", lambda c: labelled_run(c.tmp, set_entry("y_0", 7, -1)), ("y_0: record 7 has a label outside [0, ",)),
    Case("fractional-labels", lambda c: labelled_run(c.tmp, replace("y_2", lambda y: y + 0.5)),
         ("y_2: has dtype float64; class labels must be integers",)),
    Case("labels-length-differs", lambda c: labelled_run(c.tmp, replace("y_1", lambda y: y[:-1])),
         ("y_1 has shape (39,); expected (40,)",)),
    Case("missing-labels", lambda c: labelled_run(c.tmp, drop("y_2")), ("has no array 'y_2'",)),
    Case("non-symmetric-covariance", lambda c: spd_run(c.tmp, set_entry("x_1", (2, 0, 3), 9.0)),
         ("x_1 (client 1): record 2 is not symmetric",)),
    Case("singular-covariance", lambda c: spd_run(c.tmp, replace("x_0", lambda x: np.concatenate([np.ones((1, 4, 4)), x[1:]]))),
         ("x_0 (client 0): record 0 is singular or not positive definite",)),
    Case("indefinite-covariance", lambda c: spd_run(c.tmp, replace("x_2", lambda x: np.concatenate([x[:3], -x[3:4], x[4:]]))),
         ("x_2 (client 2): record 3 is singular or not positive definite",)),
    Case("covariance-not-square", lambda c: spd_run(c.tmp, replace("x_0", lambda x: x[:, :, :3])),
         ("x_0 holds records of shape (4, 3)",)),
    Case("model-needs-other-records", lambda c: vector_run(c.tmp, lambda a: None, "model.name=spdnet"),
         ("model.name='spdnet'", "choose a model for this data")),
    # data: the EEG path (MOABB's cache, SPDNet)
    Case("eeg-nan-covariance", lambda c: eeg_cache_run(c.tmp, eeg_trial(lambda c: c * np.nan)),
         ("data.options.subjects=[1]", "PhysionetMI subject 1", "record 3 is not finite", "leave the subject out")),
    Case("eeg-singular-covariance", lambda c: eeg_cache_run(c.tmp, eeg_trial(lambda c: np.ones_like(c))),
         ("PhysionetMI subject 1", "record 3 is singular or not positive definite")),
    Case("eeg-non-symmetric-covariance", lambda c: eeg_cache_run(c.tmp, eeg_trial(lambda c: c + np.triu(np.ones_like(c), 1))),
         ("PhysionetMI subject 1", "record 3 is not symmetric")),
    # environment
    Case("ray-address-without-cluster", lambda c: ["run", *SYNTHETIC, "--engine", "ray", f"ray.address=127.0.0.1:{free_port()}"],
         ("ray.address='127.0.0.1:", "no Ray cluster reachable there", "ray start --head"), subprocess=True),
    Case("ray-address-malformed", lambda c: ["run", *SYNTHETIC, "--engine", "ray", "ray.address=nohost"],
         ("ray.address='nohost'", "expected auto or HOST:PORT")),
    Case("metrics-port-in-use", lambda c: ["run", *SYNTHETIC, f"monitoring.metrics_port={c.port}"],
         ("monitoring.metrics_port=", "already in use", "choose a free port")),
    Case("output-dir-under-a-file", lambda c: ["run", *SYNTHETIC, f"run.output_dir={under_a_file(c.tmp)}"],
         ("run.output_dir=", "cannot create a run directory there", "writable directory")),
    Case("output-dir-is-a-file", lambda c: ["run", *SYNTHETIC, f"run.output_dir={under_a_file(c.tmp).parent}"],
         ("run.output_dir=", "cannot create a run directory there")),
    # --resume
    Case("resume-missing-directory", lambda c: ["run", "--resume", str(c.tmp / "nope")], ("not a run directory",), resume=True),
    Case("resume-without-checkpoint", resume(), ("no checkpoint.pt there",), resume=True,
         damage=lambda rd: (rd / "checkpoint.pt").unlink()),
    Case("resume-corrupt-checkpoint", resume(), ("checkpoint.pt is unreadable", "start a new run"), resume=True,
         damage=write("checkpoint.pt", b"\x00not a checkpoint")),
    Case("resume-truncated-checkpoint", resume(), ("checkpoint.pt is unreadable",), resume=True,
         damage=lambda rd: (rd / "checkpoint.pt").write_bytes((rd / "checkpoint.pt").read_bytes()[:300])),
    Case("resume-foreign-checkpoint", resume(), ("does not hold a rfedray checkpoint",), resume=True,
         damage=edit_checkpoint(lambda state: {"weights": torch.zeros(3)})),
    Case("resume-non-finite-checkpoint", resume(), ("checkpoint.pt holds a model that is not finite",), resume=True,
         damage=edit_checkpoint(nan_theta)),
    Case("resume-model-of-another-shape", resume("data.options.d=9"), ("checkpoint.pt holds a model of shapes",
         "resume with the configuration the run was started with"), resume=True),
    Case("resume-corrupt-budget", resume(), ("budget.json is unreadable", "will not continue it"), resume=True,
         damage=write("budget.json", b'{"fingerprint": ')),
    Case("resume-budget-is-a-directory", resume(), ("budget.json is not a file", "will not continue it"), resume=True,
         damage=lambda rd: ((rd / "budget.json").unlink(), (rd / "budget.json").mkdir())),
    Case("resume-foreign-budget", resume(), ("budget.json was not written for this run",), resume=True, damage=other_budget),
    Case("resume-clip-changed", resume("privacy.clip=0.5"),
         ("privacy.clip='changed since the checkpoint'", "privacy.clip was 0.3548, now 0.5", "start a new run"), resume=True),
    Case("resume-sigma-changed", resume("privacy.sigma=0.6"), ("privacy.sigma was 0.5, now 0.6",), resume=True),
    Case("resume-accountant-changed", resume("privacy.accountant=prirfed"), ("privacy.accountant was 'exact', now 'prirfed'",), resume=True),
    Case("resume-batch-changed", resume("federation.batch_size=20"), ("federation.batch_size was 10, now 20",), resume=True),
    Case("resume-steps-changed", resume("federation.local_steps=3"), ("federation.local_steps was 2, now 3",), resume=True),
    Case("resume-client-sizes-changed", resume("data.options.records_per_client=50"),
         ("data.client_sizes", "the clients' record counts differ"), resume=True),
    Case("resume-privacy-switched-off", resume("privacy.enabled=false"), ("privacy.enabled was True, now False",), resume=True),
    Case("resume-fewer-rounds-than-done", resume("run.rounds=2"), ("run.rounds=2", "already completed 4 rounds"), resume=True),
    Case("resume-corrupt-config", resume(), ("config=", "YAML syntax error"), resume=True,
         damage=write("config.yaml", b"run: [\n")),
    Case("resume-with-config-file", lambda c: ["run", "configs/fedpca.yaml", "--resume", str(c.run_dir)],
         ("give key=value overrides only",), resume=True),
    Case("resume-corrupt-metrics-line", resume(), ("metrics.jsonl line 2 is not JSON", "repair or remove that line"),
         resume=True, damage=corrupt_metrics_line),
]


def save_npy(tmp):
    path = tmp / "one.npy"
    np.save(path, np.zeros((3, 4)))
    return str(path)


def test_the_table_is_large_and_names_unique():
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def prior_run(tmp_path_factory):
    """A finished run in the output directory that every failing case shares."""
    root = tmp_path_factory.mktemp("runs")
    code = main(["run", *SYNTHETIC, f"run.output_dir={root}", *QUIET])
    assert code == 0
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return root, run_dir, snapshot(run_dir)


@dataclass
class Context:
    """What a case's command may refer to: a scratch folder, the run to resume, a port in use."""

    tmp: Path
    run_dir: Path
    port: int


def check_error_line(stderr: str, case: Case) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    line = lines[0]
    assert line.startswith("error: ") and "Traceback" not in stderr, stderr
    for fragment in case.expect:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    assert "backup" not in line, "an error must never advise restoring a backup"
    return line


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_input_is_one_clear_line_and_loses_nothing(case, prior_run, tmp_path, capsys, monkeypatch):
    root, run_dir, before = prior_run
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    target = tmp_path / "resumed"
    if case.resume:
        shutil.copytree(run_dir, target)
        case.damage(target)
    target_before = snapshot(target) if target.exists() else {}
    siblings = {p.name for p in root.iterdir()}
    with BusyPort() as port:
        argv = [*case.argv(Context(tmp_path, target, port)), *QUIET]
        if not any(a.startswith("run.output_dir=") for a in argv) and not case.resume:
            argv.append(f"run.output_dir={root}")
        if case.subprocess:
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
            out = subprocess.run([sys.executable, "-m", "rfedray.cli", *argv], cwd=ROOT, capture_output=True,
                                 text=True, timeout=240, env=dict(env, PYTHONWARNINGS="ignore"))
            code, stderr = out.returncode, out.stderr
        else:
            code = main(argv)
            stderr = capsys.readouterr().err
    assert code == 2, stderr
    check_error_line(stderr, case)
    assert snapshot(run_dir) == before, "the earlier run directory changed"
    if case.resume:
        assert snapshot(target) == target_before, "the resumed run directory changed"
    for new in {p.name for p in root.iterdir()} - siblings:
        assert not any(p.is_file() for p in (root / new).rglob("*")), f"a failed run left files in {new}"


def test_check_resume_refuses_what_a_resume_refuses_and_writes_nothing(prior_run, tmp_path):
    """What an engine that starts other processes (Ray) calls before starting them."""
    _, run_dir, before = prior_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    fed = Federation.prepare(load_config(copy / "config.yaml"), RunDirectory(copy))
    assert fed.check_resume().round == 4
    assert snapshot(copy) == before
    (copy / "budget.json").write_text('{"fingerprint": ')
    with pytest.raises(RfedrayError, match="budget.json is unreadable"):
        fed.check_resume()
