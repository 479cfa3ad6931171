"""Configuration: defaults, files, overrides, and one clear error per bad value."""

from pathlib import Path

import pytest

from rfedray.config import ConfigError, config_from_dict, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[1]

BAD = [
    # (overrides, field named in the error)
    (["federation.clients_per_round=11"], "federation.clients_per_round"),
    (["federation.clients_per_round=0"], "federation.clients_per_round"),
    (["federation.n_clients=0"], "federation.n_clients"),
    (["privacy.epsilon=0"], "privacy.epsilon"),
    (["privacy.epsilon=-1"], "privacy.epsilon"),
    (["privacy.delta=1.5"], "privacy.delta"),
    (["privacy.delta=0"], "privacy.delta"),
    (["privacy.clip=0"], "privacy.clip"),
    (["privacy.sigma=-0.1"], "privacy.sigma"),
    (["federation.batch_size=0"], "federation.batch_size"),
    (["federation.local_steps=0"], "federation.local_steps"),
    (["run.rounds=0"], "run.rounds"),
    (["aggregation.scheme=fedavg"], "aggregation.scheme"),
    (["optim.default.name=lbfgs"], "optim.default.name"),
    (["optim.default.lr=0"], "optim.default.lr"),
    (["model.options.manifold=hyperbolic"], "model.options.manifold"),
    (["privacy.accountant=rdp"], "privacy.accountant"),
    (["ray.num_gpus_per_actor=-1"], "ray.num_gpus_per_actor"),
    (["federation.clients_per_rnd=3"], "federation.clients_per_rnd"),
    (["run.engine=spark"], "run.engine"),
    (["federation.n_clients=abc"], "federation.n_clients"),
    (["model.name=resnet"], "model.name"),
    (["data.source=imagenet"], "data.source"),
    (["data.options.p=40"], "data.options.p"),
    (["data.options.dd=3"], "data.options.dd"),
    (["data.options.radius=0"], "data.options.radius"),
    (["data.options.radius=inf"], "data.options.radius"),
    (["monitoring.metrics_port=70000"], "monitoring.metrics_port"),
    (["privacy.epsilon=null", "privacy.sigma=null"], "privacy.epsilon"),
    (["optim.default.momentum=1.0"], "optim.default.momentum"),
]


@pytest.mark.parametrize("overrides, field", BAD, ids=[b[1] + ":" + b[0][0] for b in BAD])
def test_bad_value_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}=")


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'federation.clients_per_round'"):
        load_config(None, ["federation.clients_per_rnd=3"])


def test_default_file_equals_built_in_default():
    """But for its evaluation: the shipped job opts into the oracle (the server loads every client's
    records), the built-in default evaluates on the clients' test splits."""
    from rfedray import registry

    shipped, built_in = load_config(ROOT / "configs" / "fedpca.yaml"), load_config(None)
    assert (shipped.run.test_set, built_in.run.test_set) == ("server", "clients")
    shipped.run.test_set = built_in.run.test_set
    for cfg in (shipped, built_in):
        cfg.model.options = vars(registry.resolve_options(registry.model_module(cfg.model.name), cfg.model.options, "m"))
        cfg.data.options = vars(registry.resolve_options(registry.data_module(cfg.data.source), cfg.data.options, "d"))
    assert to_yaml(shipped) == to_yaml(built_in)


def test_overrides_win_over_file():
    cfg = load_config(ROOT / "configs" / "fedpca.yaml", ["federation.clients_per_round=2", "optim.head.lr=0.01"])
    assert cfg.federation.clients_per_round == 2
    assert cfg.optim["head"].lr == 0.01
    assert cfg.optim["default"].lr == 0.5


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_syntax_error_reports_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  rounds: 3\n federation: [\n")
    with pytest.raises(ConfigError, match="line 3"):
        load_config(bad)


def test_every_shipped_config_is_valid():
    from rfedray.mestimation import config as other

    schemas = {"mestimation_": other.MEstimationConfig, "ddpsa_": other.DDPSAConfig}
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert paths
    for path in paths:
        schema = next((s for prefix, s in schemas.items() if path.name.startswith(prefix)), None)
        if schema is None:
            load_config(path)
        else:
            other.load(schema, str(path), [])


def test_dict_round_trip():
    cfg = load_config(None, ["run.seed=3"])
    again = config_from_dict(__import__("yaml").safe_load(to_yaml(cfg)))
    assert to_yaml(again) == to_yaml(cfg)
