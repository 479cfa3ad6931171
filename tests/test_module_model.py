"""A user's torch.nn.Module as a federated model (rfedray.ModuleModel): geoopt parameters, functional
per-record gradients, and the manifolds that are refused.

The central check: an SPDNet written by a user with a geoopt EuclideanStiefel parameter trains to the
same bits as the built-in SPDNet at the same seeds (same data, same noise generator, same steps).
"""

import json

import geoopt
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import rfedray
from rfedray.config import ConfigError, load_config
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.setup import initial_params
from rfedray.geometry import Euclidean, Grassmann, Sphere, Stiefel
from rfedray.geometry.stiefel import QRRetraction
from rfedray.models.module import ModuleModel, UnsupportedManifold
from rfedray.models.spdnet import vech
from rfedray.privacy.mechanism import per_sample_gradients
from rfedray.spectral import sym_clamped_log

SPDNET_RUN = [
    "model.name=spdnet", "model.options.d=4", "data.source=synthetic_eeg", "data.options.trials_per_client=40",
    "federation.n_clients=4", "federation.clients_per_round=2", "federation.local_steps=3", "federation.batch_size=10",
    "run.rounds=4", "privacy.epsilon=5", "privacy.noise_seed=11", "privacy.clip=1.0", "run.seed=3",
    "optim.bimap.name=rsgd", "optim.bimap.lr=0.1", "optim.head.name=sgd", "optim.head.lr=0.2",
    "monitoring.progress=false",
]


class UserSPDNet(nn.Module):
    """An SPDNet as a user writes it: geoopt Stiefel BiMap, one [weight | bias] head, rfedray's spectral log."""

    def __init__(self, channels: int, d: int, num_classes: int, eps: float):
        super().__init__()
        stiefel = geoopt.EuclideanStiefel()
        self.bimap = geoopt.ManifoldParameter(stiefel.random(channels, d), manifold=stiefel)
        self.head = nn.Parameter(torch.zeros(num_classes, d * (d + 1) // 2 + 1))
        self.eps = eps

    def forward(self, x):
        features = vech(sym_clamped_log(self.bimap.mT @ x.to(self.bimap.dtype) @ self.bimap, self.eps))
        return features @ self.head[:, :-1].mT + self.head[:, -1]


def accuracy(logits, y):
    return {"accuracy": (logits.argmax(-1) == y).double().mean()}


def test_user_geoopt_spdnet_trains_to_the_same_bits_as_the_builtin(tmp_path):
    builtin = rfedray.run(None, *SPDNET_RUN, f"run.output_dir={tmp_path / 'builtin'}", engine="local", quiet=True)

    cfg = load_config(None, SPDNET_RUN)
    fed = Federation.prepare(cfg, run_dir=None)
    net = UserSPDNet(fed.model.channels, fed.model.d, fed.model.num_classes, fed.model.eps_reeig)
    with torch.no_grad():  # the built-in's starting point at this seed
        for name, value in initial_params(cfg, fed.model).items():
            getattr(net, name).copy_(value)
    model = ModuleModel(net, loss=F.cross_entropy, metrics=accuracy)
    user = rfedray.run(None, *SPDNET_RUN, f"run.output_dir={tmp_path / 'user'}", model=model, engine="local", quiet=True)

    assert list(user.final_params) == ["bimap", "head"]
    for name, value in builtin.final_params.items():
        assert torch.equal(user.final_params[name], value), name
    assert not torch.equal(user.final_params["bimap"], initial_params(cfg, fed.model)["bimap"])  # it trained
    assert user.summary["epsilon_spent"] == builtin.summary["epsilon_spent"] > 0
    assert user.summary["final_metrics"] == pytest.approx(builtin.summary["final_metrics"], rel=1e-6)
    saved = load_config(user.run_dir / "config.yaml")
    assert saved.model.name == "python-object" and saved.data.source == "synthetic_eeg"
    trained = user.load_into(net)
    assert torch.allclose(trained.bimap.mT @ trained.bimap, torch.eye(4), atol=1e-5)


class UserMLP(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.layers(x.float())


def test_user_mlp_trains_privately_on_digits(tmp_path):
    overrides = [
        "data.source=sklearn", "data.options.dataset=digits", "federation.n_clients=4", "federation.clients_per_round=4",
        "federation.local_steps=5", "federation.batch_size=50", "run.rounds=12", "privacy.epsilon=4", "privacy.clip=1.0",
        "optim.default.name=sgd", "optim.default.lr=2.0", "monitoring.progress=false", f"run.output_dir={tmp_path}",
        "run.test_set=server",  # digits' test part, held by the server
    ]
    model = ModuleModel(UserMLP(64, 32, 10), loss=F.cross_entropy, metrics=accuracy)
    assert all(isinstance(m, Euclidean) for m in model.groups.values()) and len(model.groups) == 4
    result = rfedray.run(None, *overrides, model=model, engine="local", quiet=True)
    summary = result.summary
    assert summary["private"] and summary["sigma"] > 0 and summary["epsilon_spent"] <= 4.0
    assert not summary["not_for_production"]  # OS-entropy noise
    assert summary["final_metrics"]["accuracy"] > 0.5  # ten classes: chance is 0.1
    accuracies = [r["metric_accuracy"] for r in result.metrics]
    assert len(accuracies) == 12 and accuracies[-1] > accuracies[0]


def spdnet_with_a_head():
    net = UserSPDNet(5, 3, 2, 1e-4)
    with torch.no_grad():
        net.head.normal_()  # a zero head would give the Stiefel frame a zero gradient
    return net


def spd_records(n, channels, generator):
    a = torch.randn(n, channels, 2 * channels, generator=generator)
    return a @ a.mT / (2 * channels), torch.randint(0, 2, (n,), generator=generator)


@pytest.mark.parametrize("make,records", [
    (lambda: UserMLP(5, 7, 3), lambda g: (torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g))),
    (spdnet_with_a_head, lambda g: spd_records(6, 5, g)),  # a geoopt EuclideanStiefel parameter
], ids=["mlp", "geoopt-spdnet"])
def test_per_record_gradients_are_the_module_on_each_record_alone(make, records):
    """vmap(grad) of the functional per-record loss == torch.autograd on the module, one record at a time."""
    torch.manual_seed(1)
    net = make()
    model = ModuleModel(net, loss=F.cross_entropy)
    x, y = records(torch.Generator().manual_seed(2))
    params = {name: p.detach() for name, p in net.named_parameters()}
    grads = per_sample_gradients(model.per_sample_loss, params, (x, y))
    for i in range(len(x)):
        loss = F.cross_entropy(net(x[i:i + 1]), y[i:i + 1])
        expected = torch.autograd.grad(loss, list(net.parameters()))
        for (name, _), g in zip(net.named_parameters(), expected):
            assert g.abs().max() > 0, name  # a gradient that is not trivially zero
            torch.testing.assert_close(grads[name][i], g, rtol=1e-5, atol=1e-6)
    assert torch.equal(functional_call(net, params, (x,)), model.forward(params, x))


class Stiff(nn.Module):
    def __init__(self, manifold, shape):
        super().__init__()
        start = manifold.projx(torch.randn(*shape)) if hasattr(manifold, "projx") else torch.randn(*shape)
        self.weight = geoopt.ManifoldParameter(start, manifold=manifold)

    def forward(self, x):
        return x @ self.weight


def test_canonical_stiefel_is_refused_with_why_and_what_to_use():
    with pytest.raises(UnsupportedManifold) as info:
        ModuleModel(Stiff(geoopt.Stiefel(), (5, 2)), loss=F.mse_loss)
    message = str(info.value)
    assert "'weight'" in message and "CanonicalStiefel" in message and "geoopt.Stiefel()" in message
    assert "ambient" in message and "use geoopt.EuclideanStiefel()" in message


@pytest.mark.parametrize("manifold,shape,expected", [
    (geoopt.EuclideanStiefel(), (5, 2), Stiefel(5, 2)),
    (geoopt.Sphere(), (4,), Sphere(4)),
    (geoopt.Euclidean(), (3, 2), Euclidean(3, 2)),
])
def test_supported_geoopt_manifolds_become_rfedray_manifolds(manifold, shape, expected):
    groups = ModuleModel(Stiff(manifold, shape), loss=F.mse_loss).groups
    assert type(groups["weight"]) is type(expected) and groups["weight"].shape == expected.shape


@pytest.mark.parametrize("manifold,shape,why", [
    (geoopt.PoincareBall(), (3,), "PoincareBall"),
    (geoopt.SymmetricPositiveDefinite(), (3, 3), "SymmetricPositiveDefinite"),
    (geoopt.Sphere(), (2, 4), "one (n,) vector per parameter"),
    (geoopt.EuclideanStiefel(), (2, 5, 2), "one (n, p) frame per parameter"),
])
def test_other_geoopt_manifolds_and_batched_points_are_refused(manifold, shape, why):
    with pytest.raises(UnsupportedManifold, match=why.replace("(", r"\(").replace(")", r"\)")):
        ModuleModel(Stiff(manifold, shape), loss=F.mse_loss)


def test_rfedray_manifolds_by_name_and_checks_of_the_start():
    class Basis(nn.Module):
        def __init__(self, start):
            super().__init__()
            self.projector = nn.Parameter(start)

    u = torch.linalg.qr(torch.randn(6, 2, dtype=torch.float64))[0]
    model = ModuleModel(Basis(u @ u.T), loss=F.mse_loss, manifolds={"projector": Grassmann(6, 2)})
    assert isinstance(model.groups["projector"], Grassmann)
    with pytest.raises(UnsupportedManifold, match="starts .* away from its manifold"):
        ModuleModel(Basis(u @ u.T + 0.1), loss=F.mse_loss, manifolds={"projector": Grassmann(6, 2)})
    with pytest.raises(UnsupportedManifold, match="must be an rfedray.geometry manifold of shape"):
        ModuleModel(Basis(u @ u.T), loss=F.mse_loss, manifolds={"projector": Grassmann(5, 2)})
    with pytest.raises(UnsupportedManifold, match="not trainable parameters"):
        ModuleModel(Basis(u @ u.T), loss=F.mse_loss, manifolds={"basis": Grassmann(6, 2)})


def test_the_model_must_use_the_runs_retraction(tmp_path):
    model = ModuleModel(Stiff(geoopt.EuclideanStiefel(), (5, 2)), loss=F.mse_loss, retraction="qr")
    assert isinstance(model.groups["weight"].retraction, QRRetraction)
    with pytest.raises(ConfigError, match=r"aggregation.retraction='polar': the model's group 'weight' uses QRRetraction"):
        rfedray.run(None, f"run.output_dir={tmp_path}", model=model, engine="local", quiet=True)
    assert not any(tmp_path.iterdir())  # refused before anything ran: no run directory left


def test_a_bare_module_is_told_to_be_wrapped(tmp_path):
    with pytest.raises(ConfigError, match=r"is a torch.nn.Module; wrap it as rfedray.ModuleModel\(module, loss=...\)"):
        rfedray.run(None, f"run.output_dir={tmp_path}", model=UserMLP(3, 2, 2), engine="local", quiet=True)


def test_a_resume_without_the_object_says_how(tmp_path):
    cfg = load_config(None, SPDNET_RUN)
    fed = Federation.prepare(cfg, run_dir=None)
    net = UserSPDNet(fed.model.channels, fed.model.d, fed.model.num_classes, fed.model.eps_reeig)
    fixed_noise = ["privacy.epsilon=null", "privacy.sigma=2.0"]
    first = rfedray.run(None, *SPDNET_RUN, *fixed_noise, "run.rounds=2", "run.checkpoint_every=1", f"run.output_dir={tmp_path}",
                        model=ModuleModel(net, loss=F.cross_entropy), engine="local", quiet=True)
    with pytest.raises(ConfigError, match=r"model.name='python-object': the run's model was a Python object given to "
                                          r"rfedray.run\(model=...\)"):
        rfedray.run(None, "run.rounds=3", resume=first.run_dir, engine="local", quiet=True)
    resumed = rfedray.run(None, "run.rounds=3", resume=first.run_dir, model=ModuleModel(net, loss=F.cross_entropy),
                          engine="local", quiet=True)
    assert resumed.summary["rounds_completed"] == 3 and resumed.run_dir == first.run_dir
    assert resumed.summary["epsilon_spent"] > first.summary["epsilon_spent"]
    assert [r["round"] for r in resumed.metrics] == [0, 1, 2]
    assert json.loads(RunDirectory(first.run_dir).summary.read_text())["rounds_completed"] == 3
