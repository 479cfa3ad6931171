"""Nothing leaks through the side doors.

* Every public member of :class:`rfedray.federated.client.Client` and of the Ray client actor
  (:class:`actors.client_actor.ClientActor`) is called, and nothing it returns may be a record, a
  per-sample value (gradient, loss, norm) or an unprivatised gradient (the clipped mean without
  noise, the plain mean, the update a non-private client would submit). A public member without a
  call recipe below fails the test: whoever adds one decides, here, what it may return.
* The noise generator is seeded from the operating system's entropy unless ``privacy.noise_seed``
  is set (global torch and numpy seeds do not make a run reproducible), and a seeded run is marked
  ``not_for_production`` in its summary and ``rfedray_not_for_production 1`` in its metrics.

* A client's own test result (:meth:`Client.evaluate_test`, called in the process hosting it) never
  reaches the server: the client actor's ``run`` of the evaluation task answers the metrics' names
  only and sends the values as secret shares, and an aggregator refuses to sum one client's shares alone.

(``tests/test_scrape.py`` checks the run's logs, metrics and summary.)
"""

import dataclasses
import inspect
import numbers
import re
import secrets
import types

import numpy as np
import pytest
import torch
from torch.func import vmap

from rfedray.config import load_config
from rfedray.errors import RfedrayError
from rfedray.ddpsa.secure_aggregation import FixedPointCodec, LocalAggregators, collect_sum
from rfedray.federated.client import Client, LocalResult, round_generator
from rfedray.federated.evaluation import EvaluationTask
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.setup import build_client, build_scheme, initial_params, local_plan
from rfedray.privacy import mechanism, randomness
from rfedray.privacy.mechanism import nonprivate_gradient, per_sample_gradients, sample_batch

CLIENT = 1
CFG = [
    "run.engine=local", "run.rounds=3", "federation.n_clients=3", "federation.clients_per_round=2",
    "federation.local_steps=1", "federation.batch_size=10", "data.options.d=6", "data.options.p=2",
    "data.options.records_per_client=40", "privacy.sigma=0.3", "privacy.epsilon=null", "privacy.noise_seed=5",
    "monitoring.progress=false",
]


@dataclasses.dataclass
class Secrets:
    """What a client must never release: its records and every per-record or unprivatised value."""

    vectors: list[torch.Tensor]   # records and per-record, per-batch and non-private gradients, flattened
    scalars: np.ndarray           # per-record losses and gradient norms, record entries
    nonprivate_submission: dict


def client_secrets(fed: Federation, cid: int, theta: dict, scheme: str) -> Secrets:
    cfg, model, product = fed.cfg, fed.model, fed.product
    (z,) = fed.dataset.client_data(cid).train
    loss = model.per_sample_loss
    ambient = per_sample_gradients(loss, theta, (z,))
    tangent = product.proj_tangent(theta, ambient)
    norms = product.norm(tangent)
    scale = torch.clamp(cfg.privacy.clip / norms, max=1.0)
    clipped = {g: v * scale.reshape(-1, *[1] * (v.dim() - 1)) for g, v in tangent.items()}
    generator = round_generator(cfg.privacy.noise_seed, cid, 0)
    index = sample_batch(z.shape[0], cfg.federation.batch_size, generator)
    batch_means = [
        {g: v[index].mean(0) for g, v in clipped.items()},
        nonprivate_gradient(loss, theta, product, (z[index],)),
        nonprivate_gradient(loss, theta, product, (z,)),
    ]
    plain = dataclasses.replace(local_plan(cfg, fed.privacy), mechanism=None)
    nonprivate = Client(cid, fed.dataset.client_data(cid), model, build_scheme(cfg), cfg.optim, plain)
    submission = nonprivate.local_train(theta, 0).submission
    vectors = [*z, *(v for t in (ambient, tangent, clipped) for g in t for v in t[g])]
    vectors += [g for means in batch_means for g in means.values()] + list(submission.values())
    lr = cfg.optim["default"].lr
    vectors += [theta[g] - lr * batch_means[0][g] for g in theta]
    losses = vmap(loss, in_dims=(None, 0))(theta, z)
    scalars = torch.cat([losses, norms, z.flatten()]).double().numpy()
    return Secrets([v.flatten().double() for v in vectors], scalars, submission)


def walk(obj, seen=None):
    """Every tensor and number inside ``obj`` (dataclasses, mappings, sequences, plain objects)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj.detach().cpu()
    elif isinstance(obj, (bool, str, bytes)) or obj is None:
        return
    elif isinstance(obj, numbers.Number):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from walk(getattr(obj, f.name), seen)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from walk(value, seen)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from walk(value, seen)
    elif hasattr(obj, "__dict__") and not inspect.isroutine(obj) and not isinstance(obj, type):
        for value in vars(obj).values():
            yield from walk(value, seen)


def leaks(output, found: Secrets) -> list[str]:
    """Descriptions of every secret that ``output`` contains."""
    problems = []
    for item in walk(output):
        if isinstance(item, torch.Tensor):
            if not (item.is_floating_point() and item.numel() > 1):
                continue
            flat = item.flatten().double()
            pieces = [flat]
            if item.dim() >= 2:
                pieces += list(item.reshape(-1, item.shape[-1]).double()) + list(item.reshape(-1, item.shape[-1]).T.double())
            for piece in pieces:
                for secret in found.vectors:
                    if piece.numel() == secret.numel() and torch.allclose(piece, secret, rtol=1e-4, atol=1e-7):
                        problems.append(f"a tensor of shape {tuple(item.shape)} holds a secret of {secret.numel()} values")
                        break
        elif isinstance(item, float) and np.any(np.isclose(found.scalars, item, rtol=1e-9, atol=0)):
            problems.append(f"the number {item!r} is a per-record value")
    return problems


def assert_privatised(result: LocalResult, found: Secrets, sigma: float, lr: float) -> None:
    """The submission is the non-private one plus noise of the configured size, not that one."""
    distance = sum(float(torch.linalg.vector_norm(result.submission[g].double() - found.nonprivate_submission[g].double()))
                   for g in found.nonprivate_submission)
    assert distance > 0.1 * lr * sigma, f"submission within {distance:.3g} of the non-private one: no noise?"


@pytest.fixture(scope="module", params=["projavg", "rlavg"])
def setup(request, tmp_path_factory):
    cfg = load_config(None, [*CFG, f"aggregation.scheme={request.param}"])
    fed = Federation.prepare(cfg, RunDirectory(tmp_path_factory.mktemp("unused")))
    theta = fed.model.init_params(torch.Generator().manual_seed(11))
    return fed, theta, client_secrets(fed, CLIENT, theta, request.param)


def train_once(client, theta):
    return client.local_train(theta, 0)


CLIENT_CALLS = {
    "local_train": train_once,
    "num_records": lambda client, theta: client.num_records,
    # The client's own test result, for the process hosting it (here: no test split, None); what leaves
    # that process is secret shares (ClientActor.run of the evaluation task, test_a_clients_test_result_...).
    "evaluate_test": lambda client, theta: client.evaluate_test(theta),
}
"""How to call each public member of Client; the arguments are what any caller could pass."""


def public_members(cls) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls) if not name.startswith("_")}


def test_every_public_member_of_the_client_has_a_call_recipe():
    missing = public_members(Client) - set(CLIENT_CALLS)
    assert not missing, f"new public members of Client {sorted(missing)}: add a call recipe to CLIENT_CALLS"


def test_no_public_member_of_the_client_releases_a_secret(setup):
    fed, theta, found = setup
    client = build_client(fed.cfg, CLIENT, fed.dataset, fed.model, local_plan(fed.cfg, fed.privacy))
    problems = {}
    for name in sorted(public_members(Client)):
        output = CLIENT_CALLS[name](client, theta)
        problems.update({f"Client.{name}: {p}": None for p in leaks(output, found)})
    # The object's own public attributes (model, plan, scheme, ...) hold nothing private either.
    for name, value in vars(client).items():
        if not name.startswith("_"):
            problems.update({f"Client.{name}: {p}": None for p in leaks(value, found)})
    assert not problems, "\n".join(problems)
    assert_privatised(train_once(client, theta), found, fed.cfg.privacy.sigma, fed.cfg.optim["default"].lr)


def test_the_secret_detector_sees_a_leak(setup):
    """The check has teeth: records, a per-sample gradient and the non-private update are caught."""
    fed, theta, found = setup
    (z,) = fed.dataset.client_data(CLIENT).train
    assert leaks({"records": z}, found)
    assert leaks([z[3].clone()], found)
    assert leaks(LocalResult(found.nonprivate_submission, {}, 0.0), found)
    assert leaks(float(z[2, 1]), found)
    assert not leaks(LocalResult({k: v + 0.1 for k, v in found.nonprivate_submission.items()}, {}, 0.0), found)


# ----- the Ray client actor ----------------------------------------------------------------------

ACTOR_CALLS = {
    "train": lambda actor, theta: actor.train.remote([CLIENT], theta, 0, {}),
    "describe": lambda actor, theta: actor.describe.remote(),
    "run": lambda actor, theta: actor.run.remote([0, CLIENT], EvaluationTask(FixedPointCodec(), LocalAggregators(2)), theta, 0),
}
"""How to call each public method of the client actor (through Ray, as the server does)."""


@pytest.fixture(scope="module")
def ray_session():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 1024**2)
    yield ray
    if started:
        ray.shutdown()


def test_no_public_method_of_the_client_actor_releases_a_secret(setup, ray_session):
    from actors.client_actor import ClientActor, RemoteClientActor

    fed, theta, found = setup
    assert public_members(ClientActor) == set(ACTOR_CALLS), "add a call recipe to ACTOR_CALLS for every public method"
    actor = RemoteClientActor.options(num_cpus=0).remote(fed.cfg, [0, CLIENT], local_plan(fed.cfg, fed.privacy), 1)
    try:
        problems = []
        outputs = {}
        for name in sorted(ACTOR_CALLS):
            outputs[name] = ray_session.get(ACTOR_CALLS[name](actor, theta), timeout=120)
            problems += [f"ClientActor.{name}: {p}" for p in leaks(outputs[name], found)]
        assert not problems, "\n".join(problems)
        result = outputs["train"][CLIENT]
        assert isinstance(result, LocalResult)
        assert_privatised(result, found, fed.cfg.privacy.sigma, fed.cfg.optim["default"].lr)
    finally:
        ray_session.kill(actor)


EEG = [
    "model.name=spdnet", "model.options.d=4", "data.source=synthetic_eeg", "data.options.channels=8",
    "data.options.trials_per_client=24", "federation.n_clients=3", "federation.clients_per_round=2",
    "federation.batch_size=6", "privacy.epsilon=8", "monitoring.progress=false",
]
"""Clients with test splits (synthetic EEG, SPDNet)."""


def test_a_clients_test_result_reaches_the_server_only_as_shares(ray_session, tmp_path):
    """On Ray the server calls ``ClientActor.run`` with the evaluation task: it answers the metrics'
    names only, the values go as secret shares to the aggregators, and an aggregator refuses to sum
    one client's shares alone; over two clients the server decodes their sum, the metrics of the union of their splits."""
    from actors.aggregators import RayAggregators
    from actors.client_actor import RemoteClientActor

    cfg = load_config(None, EEG)
    fed = Federation.prepare(cfg, RunDirectory(tmp_path))
    theta = initial_params(cfg, fed.model)
    plan = local_plan(cfg, fed.privacy)
    # What only the process hosting a client sees: its test records and its own test result.
    own = {cid: build_client(cfg, cid, fed.dataset, fed.model, plan).evaluate_test(theta) for cid in (0, 1)}
    test_records = [fed.dataset.client_data(cid).test[0] for cid in (0, 1)]
    scalars = [v for n, metrics in own.values() for m in metrics.values() for v in (m, n * m)]
    found = Secrets([x.flatten().double() for records in test_records for x in records], np.array(scalars), {})
    assert all(n > 0 for n, _ in own.values()) and leaks([own[0]], found)  # the detector sees a client's result

    codec = FixedPointCodec(max_parties=cfg.federation.n_clients)
    aggregators = RayAggregators(2)
    actor = RemoteClientActor.options(num_cpus=0).remote(cfg, [0, 1], plan, 1)
    try:
        task = EvaluationTask(codec, aggregators)
        names = tuple(sorted(own[0][1]))
        for round_index in (0, 1):
            answer = ray_session.get(actor.run.remote([0, 1], task, theta, round_index), timeout=120)
            assert answer == {0: names, 1: names}  # names only: the values left as shares
            assert not leaks(answer, found)
            assert aggregators.received(round_index) == [[0, 1], [0, 1]]
        with pytest.raises(ray_session.exceptions.RayTaskError, match="refuses to sum 1 < min_clients=2"):
            aggregators.partial_sums(0, [1])  # one client's shares alone: refused, and the round's shares dropped
        assert aggregators.received(0) == [[], []]
        both = collect_sum(aggregators, codec, 1)
        assert both.participants == [0, 1]
        (n0, m0), (n1, m1) = own[0], own[1]
        assert both.total[0] == n0 + n1
        union = {k: (n0 * m0[k] + n1 * m1[k]) / (n0 + n1) for k in names}
        assert np.allclose(both.total[1:1 + len(names)] / (n0 + n1), [union[k] for k in names], rtol=0, atol=1e-6)
    finally:
        ray_session.kill(actor)
        aggregators.close()


# ----- the noise generator and the not-for-production mark ------------------------------------------

def count_entropy_draws(monkeypatch) -> list[int]:
    """Bytes of OS entropy drawn for every generator key (:mod:`rfedray.privacy.randomness`)."""
    draws = []

    def token_bytes(n):
        draws.append(n)
        return secrets.SystemRandom().randbytes(n)

    monkeypatch.setattr(randomness, "secrets", types.SimpleNamespace(token_bytes=token_bytes))
    return draws


def test_noise_comes_from_os_entropy_unless_seeded(tmp_path, monkeypatch):
    from rfedray.federated.loop import run_federation

    draws = count_entropy_draws(monkeypatch)
    finals = []
    for name in ("a", "b"):
        torch.manual_seed(0)
        np.random.seed(0)
        cfg = load_config(None, [*CFG, "privacy.noise_seed=null", f"run.output_dir={tmp_path}"])
        rd = RunDirectory.create(str(tmp_path), name)
        run_federation(cfg, rd)
        finals.append(torch.load(rd.final_model)["subspace"])
    participations = 2 * cfg.run.rounds * cfg.federation.clients_per_round
    assert len(draws) == participations and set(draws) == {32}  # a 256-bit ChaCha20 key per client and round
    assert not torch.equal(*finals), "global seeds made the noise reproducible"
    draws.clear()
    cfg = load_config(None, [*CFG, f"run.output_dir={tmp_path}"])
    run_federation(cfg, RunDirectory.create(str(tmp_path), "seeded"))
    assert draws == []


@pytest.mark.parametrize("seed, marked", [("5", True), ("null", False)])
def test_seeded_runs_are_marked_not_for_production(tmp_path, monkeypatch, seed, marked):
    from rfedray import observers as observers_module, runner

    observers = []

    class Recording(observers_module.MetricsObserver):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            observers.append(self)

    monkeypatch.setattr(observers_module, "MetricsObserver", Recording)
    cfg = load_config(None, [*CFG, f"privacy.noise_seed={seed}", f"run.output_dir={tmp_path}", "monitoring.metrics_port=0"])
    rd = RunDirectory.create(str(tmp_path), "run")
    summary = runner.run(cfg, rd, quiet=True)
    assert summary["not_for_production"] is marked
    assert (rd.summary.read_text().count('"not_for_production": true') == 1) is marked
    (observer,) = observers
    value = observer.metrics.registry.get_sample_value("rfedray_not_for_production", observer.metrics.labels)
    assert value == (1.0 if marked else 0.0)


def test_the_task_host_actor_answers_only_its_tasks():
    """The M-estimation / DDP-SA client actor holds a ClientHost but is not one: its public methods
    are ``run`` (what the protocol's task releases), ``describe`` and ``close``; the host's
    ``client`` and ``build``, which hand back a client with its records, are not reachable through Ray."""
    from actors.client_actor import TaskHostActor

    assert public_members(TaskHostActor) == {"run", "describe", "close"}



def test_client_actors_refuse_a_task_the_protocol_does_not_send(setup, ray_session):
    """Both client actors run only the tasks of their protocol (exactly those types), refused before
    they run: had one run, the host would have answered its release (or a dropout), not an error; the
    refusal names the type and the allowed ones and carries nothing of the clients."""
    from actors.client_actor import RemoteClientActor, TaskHostActor
    from rfedray.federated.engine import TaskSpec
    from rfedray.mestimation.local import StepPlan
    from rfedray.mestimation.strategies import GradientTask

    class RecordsTask:
        """A task no protocol sends (defined here, so that Ray sends its code): it would hand back the
        client's records."""

        def __call__(self, client, theta, round_index):
            return client.data.train[0]

    class EvaluationButRecords(EvaluationTask):
        """A subclass of the evaluation task that runs other code."""

        __call__ = RecordsTask.__call__

    fed, theta, found = setup
    actor = RemoteClientActor.options(num_cpus=0).remote(fed.cfg, [0, CLIENT], local_plan(fed.cfg, fed.privacy), 1)
    try:
        for task in (RecordsTask(), EvaluationButRecords(FixedPointCodec(), LocalAggregators(2))):
            with pytest.raises(ray_session.exceptions.RayTaskError) as refused:
                ray_session.get(actor.run.remote([0, CLIENT], task, theta, 0), timeout=120)
            message = str(refused.value.cause)
            assert re.search(rf"ClientActor.run refuses a task of type test_side_doors\.(\S+\.)?{type(task).__name__}: "
                             r"it runs only the protocol's tasks \(EvaluationTask\)", message), message
            assert not leaks(message, found)
    finally:
        ray_session.kill(actor)

    spec = TaskSpec("rfedray.data.sklearn_data", "rfedray.models.logreg",
                    {"dataset": "synthetic_logistic", "records_per_client": 200, "d": 3, "partition": "iid"},
                    {"l2": 1e-2}, 2, 0)
    host = TaskHostActor(spec, [0, 1], threads=1)
    params = host._host.model.init_params(torch.Generator().manual_seed(0))
    with pytest.raises(RfedrayError, match=r"TaskHostActor.run refuses a task of type .*RecordsTask: it runs only "
                                           r"the protocol's tasks \(GradientTask, LocalSGDTask, LocalNewtonTask, DDPSATask\)"):
        host.run([0, 1], RecordsTask(), params, 0)
    released = host.run([0, 1], GradientTask(StepPlan(50, 1.0, 0.5, noise_seed=1)), params, 0)
    assert sorted(released) == [0, 1] and all(isinstance(r, dict) for r in released.values())
