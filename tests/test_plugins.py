"""The user's own model and data named by import path in a configuration (rfedray.plugins), and run
from the Python API with objects, on both engines.

The plugin module is ``examples/custom_model.py`` copied under a fresh name into a temporary folder
that only this process has on its path: on the Ray engine it reaches the actors because rfedray
ships it (``runtime_env`` ``py_modules``), not because the workers could import it.
"""

import importlib.util
import json
import logging
import os
import secrets
import sys
from pathlib import Path

import pytest
import ray
import torch

import rfedray
from rfedray.cli import main
from rfedray.config import load_config
from rfedray.errors import RfedrayError
from rfedray.options import OptionsError
from rfedray.plugins import code_locations

ROOT = Path(__file__).resolve().parents[1]

LOGGED = '''

class LoggedFiles(CovarianceFiles):
    """CovarianceFiles that leaves a mark naming the process that loaded each client."""

    def client_data(self, client_id):
        import os
        (self.folder / f"loaded-{client_id}-{os.getpid()}").touch()
        return super().client_data(client_id)


class Quoting(CovarianceFiles):
    """CovarianceFiles whose client 2 fails with an error that quotes one of its records."""

    def client_data(self, client_id):
        if client_id == 2:
            raise ValueError("record 7 of client 2 is 0.8125")
        return super().client_data(client_id)
'''

SMALL = ["federation.n_clients=4", "federation.clients_per_round=2", "federation.local_steps=2",
         "federation.batch_size=16", "run.rounds=3", "privacy.epsilon=8", "privacy.clip=1.0", "privacy.noise_seed=5",
         "optim.bimap.name=rsgd", "optim.bimap.lr=0.1", "optim.head.name=sgd", "optim.head.lr=0.5",
         "monitoring.progress=false", "ray.num_client_actors=2", "ray.num_cpus_per_actor=0.5",
         "run.test_set=server"]  # CovarianceFiles' test file is the server's


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """A copy of examples/custom_model.py as a module only this process can import, and its data files."""
    folder = tmp_path_factory.mktemp("plugin")
    name = f"user_plugin_{secrets.token_hex(4)}"
    (folder / f"{name}.py").write_text((ROOT / "examples" / "custom_model.py").read_text() + LOGGED)
    sys.path.insert(0, str(folder))
    module = importlib.import_module(name)
    files = module.write_files(folder / "files", n_clients=4, records=48)
    yield name, module, files
    sys.path.remove(str(folder))


def by_path(name, files):
    return [f"model.name={name}:spdnet", "model.options.d=3", f"data.source={name}:LoggedFiles",
            f"data.options.folder={files}"]


def test_plugins_by_import_path_run_from_the_command_line(plugin, tmp_path, capsys):
    name, _, files = plugin
    assert main(["run", *by_path(name, files), *SMALL, f"run.output_dir={tmp_path}", "--engine", "local"]) == 0
    run_dir = Path(capsys.readouterr().out.splitlines()[0])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["private"] and 0 < summary["epsilon_spent"] <= 8 and "accuracy" in summary["final_metrics"]
    saved = load_config(run_dir / "config.yaml")
    assert saved.model.name == f"{name}:spdnet" and saved.model.options == {"d": 3}
    assert saved.data.options == {"folder": str(files)}


@pytest.mark.parametrize("override,message", [
    ("model.options.dd=3", "model.options.dd=3: unknown key (did you mean 'd'?)"),
    ("model.options.d=three", "model.options.d='three': Value 'three' of type 'str' could not be converted to Integer"),
    ("data.options.folder=null", "data.options.folder=None: Incompatible value 'None' for field of type 'str'"),
])
def test_plugin_options_are_checked_like_builtin_ones(plugin, override, message, capsys):
    """A plugin's bad option is the options' error (like a built-in model's), one line naming the field, status 2."""
    name, _, files = plugin
    with pytest.raises(OptionsError):
        load_config(None, [*by_path(name, files), override])
    assert main(["config", "show", *by_path(name, files), override]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_a_required_plugin_option_must_be_given(plugin, capsys):
    name, _, _ = plugin
    with pytest.raises(OptionsError):
        load_config(None, [f"data.source={name}:LoggedFiles"])
    assert main(["config", "show", f"data.source={name}:LoggedFiles"]) == 2
    assert capsys.readouterr().err == "error: data.options.folder=None: is required (it has no default)\n"


@pytest.mark.parametrize("path,message", [
    ("nowhere_pkg.models:net", "cannot import 'nowhere_pkg.models': no module named 'nowhere_pkg' on the Python path; "
                               "install its package or add its folder to PYTHONPATH"),
    ("json:no_such_factory", "'json' has no attribute 'no_such_factory'"),
    ("json:__doc__", "names a str; it must name a class or a function"),
    ("not a path:x", "an import path is written package.module:name (dotted Python identifiers)"),
])
def test_a_path_that_does_not_import_is_one_clear_line(path, message, capsys):
    assert main(["config", "show", f"model.name={path}"]) == 2
    assert capsys.readouterr().err == f"error: model.name={path!r}: {message}\n"


def test_user_code_outside_site_packages_is_shipped_and_installed_code_is_not(plugin):
    name, module, files = plugin
    assert code_locations(f"{name}:spdnet", "synthetic_pca") == [module.__file__]
    assert code_locations("fedpca", "torch.nn:Linear") == []  # installed: expected on every node
    dataset = module.CovarianceFiles(str(files))
    assert code_locations("python-object", "python-object", [module.spdnet(dataset.info), dataset]) == [module.__file__]


@pytest.fixture(scope="module")
def ray_instance():
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False,
             logging_level=logging.WARNING)
    yield
    ray.shutdown()


def loaded_by(files):
    """Process ids that loaded each client, from LoggedFiles' marks (and clear them)."""
    pids = {}
    for mark in files.glob("loaded-*"):
        _, client, pid = mark.name.split("-")
        pids.setdefault(int(client), set()).add(int(pid))
        mark.unlink()
    return pids


def assert_loaded_where_hosted(files, run_dir):
    """Every client's records were loaded by the client actor hosting it, and only there."""
    placement = json.loads((Path(run_dir) / "placement.json").read_text())
    host = {client: actor["pid"] for actor in placement["client_actors"] for client in actor["clients"]}
    assert loaded_by(files) == {client: {pid} for client, pid in host.items()} and os.getpid() not in host.values()


def test_user_model_and_data_run_privately_on_ray_by_path_and_from_the_api(plugin, ray_instance, tmp_path, capsys):
    name, module, files = plugin
    workers_see_it = ray.get(ray.remote(lambda: importlib.util.find_spec(name) is not None).remote())
    assert not workers_see_it  # only rfedray's shipping brings the plugin to the actors

    local = rfedray.run(None, *by_path(name, files), *SMALL, f"run.output_dir={tmp_path}", engine="local", quiet=True)
    assert all(pids == {os.getpid()} for pids in loaded_by(files).values())

    # By import path, from the command line, on Ray.
    assert main(["run", *by_path(name, files), *SMALL, f"run.output_dir={tmp_path}", "--engine", "ray", "--quiet"]) == 0
    run_dir = Path(capsys.readouterr().out.splitlines()[0])
    by_config = json.loads((run_dir / "summary.json").read_text())
    assert_loaded_where_hosted(files, run_dir)
    assert by_config["epsilon_spent"] == local.summary["epsilon_spent"] > 0
    final = torch.load(run_dir / "model_final.pt")
    for group, value in local.final_params.items():
        assert torch.equal(final[group], value), group  # the same bits on both engines

    # The same model and data as objects from the Python API, on Ray: the objects travel to the actors.
    dataset = module.LoggedFiles(str(files))
    api = rfedray.run(None, *SMALL, f"run.output_dir={tmp_path}", model=module.spdnet(dataset.info, d=3),
                      dataset=dataset, engine="ray", quiet=True)
    assert_loaded_where_hosted(files, api.run_dir)
    assert api.summary["private"] and api.summary["epsilon_spent"] == local.summary["epsilon_spent"]
    for group, value in local.final_params.items():
        assert torch.equal(api.final_params[group], value), group
    assert load_config(api.run_dir / "config.yaml").model.name == "python-object"


def refused_on_ray(module, dataset, output_dir):
    """The error of a private run of ``dataset`` on Ray; checks that nothing was charged or trained."""
    with pytest.raises(RfedrayError) as refused:
        rfedray.run(None, *SMALL, f"run.output_dir={output_dir}", model=module.spdnet(dataset.info, d=3),
                    dataset=dataset, engine="ray", quiet=True)
    for budget in output_dir.glob("*/budget.json"):
        assert sum(json.loads(budget.read_text())["ledger"]["participations"]) == 0
    assert not list(output_dir.glob("*/metrics.jsonl"))
    return str(refused.value)


def test_on_ray_a_client_that_cannot_load_its_records_stops_the_run_before_any_charge(plugin, ray_instance, tmp_path):
    """Client 1's file holds 40 records where the index declares 48 (the accountant's B/m), or client 2's
    loading fails with a message quoting a record: its client actor does not start, so the run is refused
    before round 0, and the error says neither what the client holds nor the data's own message."""
    name, module, _ = plugin
    files = module.write_files(tmp_path / "files", n_clients=4, records=48)
    quoting = refused_on_ray(module, module.Quoting(str(files)), tmp_path / "quoting")
    assert quoting.startswith("a client actor failed to start: ") and "0.8125" not in quoting
    assert quoting.endswith("client 2: ValueError while loading its records (its message is in the client actor's log, "
                            "on the client's node)")
    short = torch.load(files / "client_1.pt")
    torch.save({"x": short["x"][:40], "y": short["y"][:40]}, files / "client_1.pt")
    lacking = refused_on_ray(module, module.CovarianceFiles(str(files)), tmp_path / "lacking")
    assert lacking.startswith("a client actor failed to start: ") and "client 1 does not hold the 48 training records" in lacking
    assert "40" not in lacking
