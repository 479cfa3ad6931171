"""What the processes of a run import: the memory each one holds starts with its imports.

A client actor of federated PCA (closed-form per-record gradients) imports neither scipy (only the
privacy ledger and its calibration use it, in the process that does the server's part) nor
``torch._dynamo`` (only steps through ``torch.func`` need it); reading the command line imports
no scipy (``rfedray audit``'s statistics are imported where they are used).
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FEDPCA_ACTOR = """
import json, sys
import torch
from actors.client_actor import ClientActor
from rfedray.config import load_config
from rfedray.federated.setup import build_dataset, build_model, local_plan, resolve_privacy

cfg = load_config(None, ["federation.n_clients=4", "federation.clients_per_round=2", "federation.local_steps=2",
                         "federation.batch_size=20", "data.options.d=8", "data.options.p=2",
                         "data.options.records_per_client=100", "privacy.sigma=0.5", "privacy.epsilon=null"])
plan = local_plan(cfg, resolve_privacy(cfg, [100] * 4))
actor = ClientActor(cfg, [0, 1], plan, threads=1)
dataset = build_dataset(cfg)
theta = build_model(cfg, dataset.info).init_params(torch.Generator().manual_seed(0))
trained = actor.train([0, 1], theta, 0, {})
assert all(type(r).__name__ == "LocalResult" for r in trained.values()), trained
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "scipy" or m.startswith("torch._dynamo"))))
"""

PARSER = """
import json, sys
from rfedray.cli import build_parser

build_parser()
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "scipy")))
"""


def imported(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_federated_pca_client_actor_imports_neither_scipy_nor_dynamo():
    assert imported(FEDPCA_ACTOR) == []


def test_reading_the_command_line_imports_no_scipy():
    assert imported(PARSER) == []
