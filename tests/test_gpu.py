"""GPU checks (marked ``gpu``): client actors on a CUDA device, the private step on CUDA against the CPU,
16 clients packed on one GPU.

``pytest -m gpu`` collects them (the default run leaves them out); on a machine where torch cannot
use CUDA, ``tests/conftest.py`` skips each one with the reason (torch's build and the driver, from
:func:`rfedray.cuda.cuda_report`). ``scripts/gpu_checks.sh`` runs every ``gpu`` test and the GPU
benchmark (``benchmarks/gpu_suite.py``) in under 5 minutes.

Tolerances: the private step is compared in float64 with the same standard noise (drawn on the CPU,
moved to the GPU): CUDA and CPU kernels sum in different orders, so they agree to rounding, stated
as ``rtol = 1e-9`` (observed differences are around 1e-14, eigendecompositions included); the
16 clients trained together against one by one on the GPU in float32, ``rtol = 1e-4``.
"""

import logging
import sys
from pathlib import Path

import pytest
import ray
import torch

# Everything imported here, at the top: every test run collects this module before leaving its tests
# out, so a renamed function the GPU tests use fails there, not first on a GPU machine.
from actors.engine import ray_executor
from rfedray.config import load_config
from rfedray.federated.executor import LocalExecutor
from rfedray.federated.loop import Federation
from rfedray.federated.rundir import RunDirectory
from rfedray.federated.setup import initial_params, local_plan
from rfedray.geometry import ProductManifold
from rfedray.privacy.mechanism import noise_generator, private_gradient, standard_noise

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_batched import _on_device  # noqa: E402  (benchmarks/ is not a package; each client's records on the device)
from bench_eeg_step import CASES  # noqa: E402

pytestmark = pytest.mark.gpu  # skipped with the reason where torch cannot use CUDA (conftest.py)

STEP_RTOL = 1e-9
PACKED_RTOL = 1e-4


@pytest.mark.parametrize("case", ["fedpca", "spdnet", "eegnet"])
def test_the_private_step_on_cuda_equals_the_cpu(case):
    build, batch = CASES[case]
    generator = torch.Generator().manual_seed(0)
    built = build(torch.float64, batch, generator)
    model, product = built.model, ProductManifold(built.model.groups)
    params = model.init_params(generator)
    noise = standard_noise(product, params, noise_generator(0))

    def step(device):
        on = {g: v.to(device) for g, v in params.items()}
        return private_gradient(
            model.per_sample_loss, on, product, tuple(r.to(device) for r in built.records), clip=built.clip,
            sigma=built.sigma, noise={g: v.to(device) for g, v in noise.items()}, rule=model.gradient_rule)

    cpu, cuda = step("cpu"), step("cuda")
    for g in cpu:
        assert cuda[g].device.type == "cuda"
        torch.testing.assert_close(cuda[g].cpu(), cpu[g], rtol=STEP_RTOL, atol=STEP_RTOL * float(cpu[g].abs().max()))


def test_sixteen_clients_packed_on_one_gpu_train_like_one_by_one(tmp_path):
    cfg = load_config(None, [
        "federation.n_clients=16", "federation.clients_per_round=16", "federation.local_steps=3",
        "federation.batch_size=50", "data.options.d=40", "data.options.p=4", "data.options.records_per_client=500",
        "privacy.noise_seed=0", "privacy.sigma=0.5", "privacy.epsilon=null",
        f"run.output_dir={tmp_path}",
    ])
    fed = Federation.prepare(cfg, RunDirectory.create(str(tmp_path), "packed"))
    plan = local_plan(cfg, fed.privacy)
    theta = {g: v.cuda() for g, v in initial_params(cfg, fed.model).items()}
    cohort = list(range(16))
    together = LocalExecutor(cfg, _on_device(fed.dataset, "cuda"), fed.model, plan).train(cohort, theta, 0, {})
    one_by_one = LocalExecutor(cfg, _on_device(fed.dataset, "cuda"), fed.model, plan, vectorise=False).train(
        cohort, theta, 0, {})
    for cid in cohort:
        for g, value in together[cid].submission.items():
            assert value.device.type == "cuda"
            torch.testing.assert_close(value, one_by_one[cid].submission[g], rtol=PACKED_RTOL, atol=PACKED_RTOL)


@pytest.fixture
def local_ray_with_the_gpu():
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    yield
    ray.shutdown()


def test_client_actors_share_the_gpu_and_train_on_it(tmp_path, local_ray_with_the_gpu):
    cfg = load_config(None, [
        "run.engine=ray", "run.rounds=3", f"run.output_dir={tmp_path}", "monitoring.progress=false",
        "federation.n_clients=16", "federation.clients_per_round=8", "ray.num_client_actors=4",
        "ray.num_gpus_per_actor=0.25", "ray.num_cpus_per_actor=0.5", "ray.device=cuda",
        "privacy.sigma=0.5", "privacy.epsilon=null",
    ])
    fed = Federation.prepare(cfg, RunDirectory.create(str(tmp_path), "gpu-actors"))
    executor = ray_executor(fed)
    try:
        actors = executor.describe()
        summary = fed.run(executor)
    finally:
        executor.close()
    assert [a["device"] for a in actors] == ["cuda:0"] * 4  # four actors share the one GPU
    assert all(len(a["gpu_ids"]) == 1 for a in actors)
    assert summary["rounds_completed"] == 3 and summary["client_failures"] == 0
