"""Federated SPDNet and EEGNet on the real PhysionetMI files, read through MOABB with the network blocked.

The runs use the recommended ``configs/eeg_physionet_*.yaml`` (17 subjects = 17 clients, half of
every subject's trials held out; the quick tests take its first five subjects, ``FIVE``, the
ten-seed test its first ten, ``TEN``) and the preprocessing cache (``rfedray.paths.cache_dir() /
"eeg"``) (the first load takes a few seconds per subject; later ones read the cache). Accuracy is
judged on the pooled held-out trials of the clients by a one-sided binomial test against chance (1/2).
"""

import ipaddress
import socket
from pathlib import Path

import pytest
import torch
from scipy.stats import binomtest

from rfedray.cli import main
from rfedray.config import load_config
from rfedray.data.eeg import DATASETS
from rfedray.federated.loop import run_federation
from rfedray.federated.rundir import RunDirectory, new_run_id
from rfedray.federated.setup import build_dataset

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SPDNET = CONFIGS / "eeg_physionet_spdnet.yaml"
EEGNET = CONFIGS / "eeg_physionet_eegnet.yaml"
PAPER_CONFIGS = sorted(p for p in CONFIGS.glob("eeg_*.yaml") if "physionet" not in p.name)


def first_subjects(n: int) -> list[str]:
    """The first ``n`` subjects of the recommended configurations, one a client."""
    subjects = ",".join(str(s) for s in range(1, n + 1))
    return [f"data.options.subjects=[{subjects}]", f"federation.n_clients={n}", f"federation.clients_per_round={n}"]


FIVE = first_subjects(5)
TEN = first_subjects(10)

needs_physionet = pytest.mark.skipif(not DATASETS["PhysionetMI"].default_path.is_dir(), reason="the shared EEG files are not there")


def _local_addresses() -> set[str]:
    names = {"localhost", socket.gethostname()}
    addresses = {"127.0.0.1", "::1"}
    for name in list(names):
        try:
            addresses |= {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    return names | addresses


@pytest.fixture(scope="module")
def offline():
    """No network: TCP connections and name lookups beyond this machine fail (Ray's local ones pass)."""
    local = _local_addresses()
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def is_local(host) -> bool:
        if host is None or str(host) in local:
            return True
        try:
            return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
        except ValueError:
            return False

    def guarded_connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM and not is_local(address[0]):
            raise OSError(f"network access is blocked in this test ({address[0]})")
        return connect(sock, address)

    def guarded_getaddrinfo(host, *args, **kwargs):
        if not is_local(host):
            raise socket.gaierror(f"name lookup is blocked in this test ({host})")
        return getaddrinfo(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", guarded_connect)
        mp.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
        mp.delenv("MNE_DATASETS_EEGBCI_PATH", raising=False)
        yield


def run_config(path, overrides, output_dir):
    """Run a configuration on the local engine; the summary, the run directory and the config."""
    cfg = load_config(path, [*overrides, f"run.output_dir={output_dir}", "monitoring.progress=false"])
    run_dir = RunDirectory.create(str(output_dir), new_run_id(cfg.run.name))
    return run_federation(cfg, run_dir), run_dir, cfg


def held_out(summary, cfg) -> tuple[int, int, float]:
    """Correct and total pooled held-out trials of a run, and the one-sided binomial p-value against 1/2."""
    total = build_dataset(cfg).eval_data().tensors[1].shape[0]
    correct = round(summary["final_metrics"]["accuracy"] * total)
    return correct, total, binomtest(correct, total, 0.5, alternative="greater").pvalue


ALL_CHANNELS = ["data.options.channels=null", "model.options.init_filters=null", "model.options.scale_free=false",
                "model.options.d=16",
                "run.rounds=300", "federation.local_steps=3", "federation.batch_size=8", "optim.bimap.lr=0.03",
                "optim.head.lr=0.03"]
"""All 64 channels with a Haar-random BiMap (d = 16, Cho2017's Table 5 value) and Table 11's step size and horizon:
the pipeline before the 17-subject configuration (which picks 21 channels and starts at six of them), kept as the
check that the generic SPDNet learns from the real files."""


def nonprivate(seed: int, clients: list[str] = FIVE) -> list[str]:
    """``ALL_CHANNELS`` on the ``clients`` (``FIVE`` or ``TEN``), non-private, at ``seed``."""
    return [*clients, *ALL_CHANNELS, "privacy.enabled=false", f"run.seed={seed}", f"privacy.noise_seed={seed}",
            "run.evaluate_every=300", "run.checkpoint_every=300"]


@needs_physionet
def test_physionet_clients_are_the_five_subjects(offline):
    dataset = build_dataset(load_config(SPDNET, FIVE))
    assert dataset.info["subjects"] == [[1], [2], [3], [4], [5]] and dataset.info["record_shape"] == (21, 21)
    assert dataset.client_sizes() == [22, 22, 22, 22, 23]
    assert dataset.eval_data().tensors[1].shape[0] == 225 - 111
    assert {f"subject_{s:03d}.npz" for s in range(1, 6)} <= {p.name for p in dataset.cache.folder.glob("subject_*.npz")}


@needs_physionet
def test_nonprivate_federated_spdnet_beats_chance(offline, tmp_path):
    """Non-private ProjAvg over the five subjects on all channels (``ALL_CHANNELS``), 300 rounds, seed 0.

    Seed 0 is not the only one: see the ten-seed test below, and the seeds reported with the change.
    """
    summary, _, cfg = run_config(SPDNET, nonprivate(0), tmp_path)
    correct, total, p_value = held_out(summary, cfg)
    print(f"federated SPDNet, non-private, seed 0: {correct}/{total} = {correct / total:.3f}, p = {p_value:.2g}")
    assert summary["rounds_completed"] == 300 and summary["epsilon_spent"] is None and total == 114
    assert p_value < 0.01


@needs_physionet
@pytest.mark.slow
def test_nonprivate_federated_spdnet_beats_chance_over_ten_seeds(offline, tmp_path):
    """Seeds 0-9 on the first ten subjects (``TEN``, 226 held-out trials), one binomial test per seed.

    The seeds differ in their initial model and minibatches; the test split is the same for all
    (the configuration's ``split_seed: 0``), so their p-values are dependent. Under any dependence,
    ``K p_(r) / r`` (the r-th smallest of K p-values, scaled) is a valid p-value (Rueschendorf
    1982; Vovk and Wang 2020); with r = 5 of K = 10, the claim is that at least half of the seeds
    reach p < 0.005.

    Why ten subjects: on the five of the quick test (114 held-out trials) p < 0.005 needs 72
    correct (63.2 %), about what the median seed reaches (71-72), so the claim held or failed by a
    trial (combined p 0.011 after the split was fixed). Ten subjects double the test trials with the
    same learning setting; p < 0.005 then needs 133 of 226 (58.8 %). The number was chosen on
    validation splits (``data.options.evaluate_on=validation``: a quarter of each subject's training
    trials, each seed its own, the test splits set aside unseen), seeds 0-9, accuracy median (mean):
    5 subjects (30 trials) 0.617 (0.640), 10 subjects (60) 0.642 (0.648), 17 subjects (102) 0.603
    (0.616); 10 has the widest margin over its threshold (17 needs 56.7 % of 386) at half the time
    of 17. Measured with the change: every seed p < 0.005 (135-154 of 226, median 142.5), combined
    p 7.9e-5, 95 s for the ten seeds on 2 cores (the five subjects take 8 s a seed).
    """
    p_values = []
    for seed in range(10):
        summary, _, cfg = run_config(SPDNET, nonprivate(seed, TEN), tmp_path / str(seed))
        correct, total, p_value = held_out(summary, cfg)
        print(f"seed {seed}: {correct}/{total} = {correct / total:.3f}, p = {p_value:.2g}")
        assert total == 226
        p_values.append(p_value)
    combined = 10 * sorted(p_values)[4] / 5
    print(f"combined p = {combined:.2g}")
    assert combined < 0.01


@needs_physionet
@pytest.mark.parametrize("scheme", ["projavg", "rlavg", "retavg"])
def test_private_spdnet_stiefel_weight_stays_on_the_manifold(offline, tmp_path, scheme):
    summary, run_dir, _ = run_config(SPDNET, [*FIVE, f"aggregation.scheme={scheme}", "run.rounds=10", "privacy.epsilon=20",
                                           "run.evaluate_every=10", "privacy.noise_seed=1"], tmp_path)
    assert summary["private"] and 0 < summary["epsilon_spent"] <= 20 and summary["rounds_completed"] == 10
    w = torch.load(run_dir.final_model)["bimap"].double()
    assert w.shape == (21, 2)  # the 21 sensorimotor channels to the two filters of model.options.init_filters
    torch.testing.assert_close(w.T @ w, torch.eye(2, dtype=torch.float64), atol=1e-5, rtol=0)
    assert summary["final_metrics"]["accuracy"] == summary["final_metrics"]["accuracy"]  # not NaN


@needs_physionet
@pytest.mark.slow
def test_private_spdnet_on_the_ray_engine(offline, tmp_path):
    """Epsilon 20 over the configuration's rounds on its first five subjects, client actors on Ray (they read the warm cache)."""
    from rfedray.runner import run

    dataset = build_dataset(load_config(SPDNET, FIVE))
    assert len(dataset.client_sizes()) == 5
    cfg = load_config(SPDNET, [*FIVE, "run.engine=ray", "run.seed=0", "privacy.noise_seed=0", "run.evaluate_every=1000",
                               f"run.output_dir={tmp_path}", "monitoring.progress=false", "ray.num_client_actors=2"])
    run_dir = RunDirectory.create(str(tmp_path), new_run_id(cfg.run.name))
    summary = run(cfg, run_dir, quiet=True)
    correct, total, p_value = held_out(summary, cfg)
    print(f"federated SPDNet on Ray, epsilon {summary['epsilon_spent']:.4g} (sigma {summary['sigma']:.3g}): "
          f"{correct}/{total} = {correct / total:.3f}, p = {p_value:.2g}")
    assert summary["engine"] == "ray" and summary["rounds_completed"] == cfg.run.rounds and not summary["halted"]
    assert summary["epsilon_spent"] <= 20
    w = torch.load(run_dir.final_model)["bimap"].double()
    torch.testing.assert_close(w.T @ w, torch.eye(2, dtype=torch.float64), atol=1e-5, rtol=0)


@needs_physionet
@pytest.mark.slow
@pytest.mark.parametrize("privacy", [["privacy.enabled=false"], ["privacy.epsilon=20"]], ids=["non-private", "epsilon-20"])
def test_federated_eegnet_runs(offline, tmp_path, privacy):
    """EEGNet the same way, on the configuration's first five subjects, over 60 rounds.

    Its accuracy is printed, not asserted: on five subjects EEGNet may stay at chance.
    """
    summary, _, cfg = run_config(EEGNET, [*FIVE, *privacy, "run.rounds=60", "run.seed=0", "privacy.noise_seed=0",
                                          "run.evaluate_every=60", "run.checkpoint_every=60"], tmp_path)
    correct, total, p_value = held_out(summary, cfg)
    print(f"federated EEGNet {privacy[0]}: {correct}/{total} = {correct / total:.3f}, p = {p_value:.2g}")
    assert summary["rounds_completed"] == 60 and not summary["halted"]
    assert summary["epsilon_spent"] is None or summary["epsilon_spent"] <= 20
    assert 0.0 <= summary["final_metrics"]["accuracy"] <= 1.0


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("eeg_*.yaml")), ids=lambda p: p.stem)
def test_configs_load(capsys, config):
    assert main(["config", "show", str(config), "privacy.epsilon=5", "federation.clients_per_round=1"]) == 0
    assert "epsilon: 5.0" in capsys.readouterr().out
