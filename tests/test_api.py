"""The Python API (rfedray.run, rfedray.load), the client-partition interface of the user's data, the
packaged configurations, --version, and the progress bars."""

import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rfedray
from rfedray.cli import main
from rfedray.config import ConfigError, to_yaml
from rfedray.errors import RfedrayError
from rfedray.paths import packaged_configs
from rfedray.progress import bar

ROOT = Path(__file__).resolve().parents[1]


def test_a_config_reads_the_same_from_a_file_a_name_a_dict_and_overrides(tmp_path):
    overrides = ("run.rounds=7", "federation.n_clients=12")
    from_file = rfedray.load(ROOT / "configs" / "fedpca.yaml", *overrides)
    from_name = rfedray.load("fedpca", *overrides)
    from_dict = rfedray.load({"run": {"rounds": 7, "test_set": "server"}, "federation": {"n_clients": 12}, "model": {"options": {"manifold": "grassmann"}},
                              "data": {"options": {"d": 40, "p": 4, "records_per_client": 2000}}})
    assert to_yaml(from_file) == to_yaml(from_name) == to_yaml(rfedray.load(from_dict)) == to_yaml(from_dict)
    with pytest.raises(ConfigError, match=r"federation.clients_per_round=5: must be between 1 and federation.n_clients \(3\)"):
        rfedray.load({"federation": {"n_clients": 3}})
    with pytest.raises(ConfigError, match="config file not found \\(packaged configurations: .*fedpca"):
        rfedray.load("no_such_config")


class Lines(rfedray.ClientPartitions):
    """y = <w, x> on Gaussian x, client i holding sizes[i] records (or `held[i]` when it lies)."""

    info = {"features": 3}

    def __init__(self, sizes, held=None, evaluate=True):
        self.sizes, self.held, self.evaluate = sizes, held or sizes, evaluate

    def client_sizes(self):
        return list(self.sizes)

    def client_data(self, client_id):
        g = torch.Generator().manual_seed(client_id)
        x = torch.randn(self.held[client_id], 3, generator=g)
        return rfedray.ClientData(train=(x, x @ torch.tensor([1.0, -2.0, 0.5])))

    def eval_data(self):
        if not self.evaluate:
            return rfedray.EvalData(())
        x = torch.randn(64, 3, generator=torch.Generator().manual_seed(99))
        return rfedray.EvalData((x, x @ torch.tensor([1.0, -2.0, 0.5])))


def linear_model():
    torch.manual_seed(0)
    return rfedray.ModuleModel(nn.Linear(3, 1), loss=lambda out, y: F.mse_loss(out.squeeze(-1), y))


RUN = ["federation.n_clients=3", "federation.clients_per_round=3", "federation.local_steps=5", "federation.batch_size=10",
       "run.rounds=6", "privacy.epsilon=10", "privacy.clip=5.0", "optim.default.name=sgd", "optim.default.lr=0.3",
       "monitoring.progress=false", "run.test_set=server"]  # Lines' eval_data: a test set the server holds


def test_a_client_holding_other_than_its_declared_size_stops_the_run_before_any_charge(tmp_path, caplog):
    # The honest run's noise is seeded: with OS entropy its final loss over the initial one has mean 0.024
    # and a long right tail (0.15 in 400 runs), which could cross 1/3 by chance.
    honest = rfedray.run(None, *RUN, "privacy.noise_seed=1", f"run.output_dir={tmp_path / 'honest'}",
                         model=linear_model(), dataset=Lines([40, 40, 40]), engine="local")
    start = linear_model()
    initial_loss = start.evaluate(start.init_params(None), Lines([40]).eval_data())["loss"]  # about |w|^2 = 5.25
    assert honest.summary["client_failures"] == 0 and honest.summary["final_metrics"]["loss"] < initial_loss / 3
    # Client 1 declares 40 records (the accountant's B/m) but holds 20: the local engine loads every client
    # before round 0, as client actors do, so the run is refused before anything is charged.
    with pytest.raises(RfedrayError) as refused:
        rfedray.run(None, *RUN, f"run.output_dir={tmp_path / 'lying'}", model=linear_model(),
                    dataset=Lines([40, 40, 40], held=[40, 20, 40]), engine="local")
    assert "client 1 does not hold the 40 training records" in str(refused.value)
    said = [r.getMessage() + (r.exc_text or "") for r in caplog.records] + [str(refused.value)]
    assert not any("20" in line for line in said)  # what it holds is not declared: not in the error or logs either
    assert not list((tmp_path / "lying").glob("*/budget.json")) and not list((tmp_path / "lying").glob("*/metrics.jsonl"))


def test_data_without_server_evaluation_runs(tmp_path):
    result = rfedray.run(None, *RUN, f"run.output_dir={tmp_path}", model=linear_model(),
                         dataset=Lines([40, 40, 40], evaluate=False), engine="local")
    assert result.summary["final_metrics"] == {} and result.summary["rounds_completed"] == 6
    assert not torch.equal(result.final_params["weight"], linear_model().module.weight.detach())


def test_an_object_that_is_not_a_dataset_says_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"dataset='list': gives a list, not a federated dataset \(missing num_clients, "
                                          r"info, client_sizes, client_data, eval_data\); subclass rfedray.ClientPartitions"):
        rfedray.run(None, f"run.output_dir={tmp_path}", dataset=[1, 2], engine="local")


def test_version_and_config_init(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"rfedray {rfedray.__version__}\n"
    assert main(["config", "init", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(packaged_configs()) == sorted(
        p.name for p in (ROOT / "configs").glob("*.yaml"))
    (tmp_path / "fedpca.yaml").write_text("run: {rounds: 2}\n")
    assert main(["config", "init", str(tmp_path)]) == 0  # an edited file is kept
    assert (tmp_path / "fedpca.yaml").read_text() == "run: {rounds: 2}\n"
    assert f"kept     {tmp_path / 'fedpca.yaml'} (exists)" in capsys.readouterr().out


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_draw_on_a_terminal_only():
    terminal, log = Terminal(), io.StringIO()
    assert list(bar(range(3), desc="subjects", stream=terminal)) == [0, 1, 2]
    assert list(bar(range(3), desc="subjects", stream=log)) == [0, 1, 2]
    assert "subjects:   0%" in terminal.getvalue() and "0/3" in terminal.getvalue() and log.getvalue() == ""


def test_cache_and_data_folders_are_the_users_not_the_packages(tmp_path, monkeypatch):
    from rfedray.data.eeg import default_cache_dir
    from rfedray.paths import cache_dir, data_dir

    monkeypatch.delenv("RFEDRAY_CACHE_DIR", raising=False)
    monkeypatch.delenv("RFEDRAY_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "share"))
    assert cache_dir() == tmp_path / "cache" / "rfedray" and default_cache_dir() == tmp_path / "cache" / "rfedray" / "eeg"
    assert data_dir() == tmp_path / "share" / "rfedray"
    package = Path(rfedray.__file__).parent
    assert not cache_dir().is_relative_to(package) and not data_dir().is_relative_to(package)
    monkeypatch.setenv("RFEDRAY_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("RFEDRAY_DATA_DIR", "~/rfedray-data")
    assert cache_dir() == tmp_path / "elsewhere" and data_dir() == Path.home() / "rfedray-data"
