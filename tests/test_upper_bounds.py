"""Item 2 of issue 16: only accountants that bound epsilon from above run, charge, halt and calibrate.

The central-limit accountant ``clt`` is an approximation (one measured run: 1.24 against the exact
4.38); a run, a ledger or a calibration that accepted it would under-count. It stays for
``rfedray privacy epsilon`` read-outs, labelled as an approximation.
"""

import json

import pytest

from rfedray import cli
from rfedray.config import ConfigError, load_config
from rfedray.mestimation.runner import run_strategy
from rfedray.privacy.accountants import (
    ACCOUNTANTS, UPPER_BOUNDS, CLTAccountant, ExactAccountant, calibrate_sigma,
)
from rfedray.privacy.ledger import PrivacyLedger
from rfedray.privacy.plan import GaussianMechanism
from rfedray.privacy.checks import PrivacyParameterError

MECHANISM = ["--delta", "1e-5", "--rounds", "50", "--local-steps", "10", "--batch-size", "100",
             "--records", "2000", "--clip", "0.3548"]


def test_upper_bounds_are_exact_and_prirfed():
    assert UPPER_BOUNDS == ("exact", "prirfed") and "clt" in ACCOUNTANTS
    assert not CLTAccountant.upper_bound and ExactAccountant.upper_bound


def test_a_run_refuses_the_clt_accountant_in_one_line(capsys):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["privacy.accountant=clt"])
    assert err.value.field == "privacy.accountant"
    assert cli.main(["run", "privacy.accountant=clt", "--engine", "local"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: privacy.accountant='clt': must be one of exact, prirfed")
    assert "not an upper bound" in lines[0]


def test_the_ledger_and_the_calibration_refuse_an_approximation():
    with pytest.raises(PrivacyParameterError, match=r"accountant='clt': must be one of exact, prirfed") as err:
        PrivacyLedger(CLTAccountant(), GaussianMechanism(sigma=0.05, clip=0.3548, batch_size=100), local_steps=10,
                      delta=1e-5, epsilon_target=1.0, client_sizes=[2000] * 4)
    assert err.value.name == "accountant"
    with pytest.raises(PrivacyParameterError, match="accountant='clt'"):
        calibrate_sigma(CLTAccountant(), epsilon=1.0, delta=1e-5, rounds=50, local_steps=10, batch_size=100,
                        records=2000, clip=0.3548)


def test_mestimation_refuses_the_clt_accountant():
    from rfedray.federated.engine import LocalEngine, TaskSpec
    from rfedray.mestimation.strategies import FedSGD

    spec = TaskSpec("rfedray.data.sklearn_data", "rfedray.models.logreg",
                    {"dataset": "synthetic_regression", "records_per_client": 100, "d": 3}, {"l2": 0.0}, 2, 0)
    dataset = spec.build_dataset()
    model = spec.build_model(dataset.info)
    with pytest.raises(PrivacyParameterError, match="accountant='clt'"):
        run_strategy(FedSGD(0.1), LocalEngine(dataset, model), model, dataset, rounds=2, clients_per_round=2,
                     batch_size=10, epsilon=1.0, accountant="clt", seed=0)


def test_privacy_calibrate_refuses_clt_and_epsilon_labels_it(capsys):
    assert cli.main(["privacy", "calibrate", "--epsilon", "1", *MECHANISM, "--accountant", "clt"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: --accountant=clt: must be one of exact, prirfed")
    assert cli.main(["privacy", "epsilon", "--sigma", "0.05", *MECHANISM, "--accountant", "clt"]) == 0
    assert "approximation" in capsys.readouterr().out
    assert cli.main(["privacy", "epsilon", "--sigma", "0.05", *MECHANISM, "--accountant", "clt", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["upper_bound"] is False
    assert cli.main(["privacy", "epsilon", "--sigma", "0.05", *MECHANISM, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["upper_bound"] is True
