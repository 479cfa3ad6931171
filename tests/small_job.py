"""The small seeded job that the run-directory tests run through the CLI (``tests/test_rundir.py``,
``tests/test_storage.py``): a fixed noise and no target to halt at; a round takes milliseconds on the
local engine."""

SMALL_JOB = [
    "run.engine=local", "run.rounds=12", "run.checkpoint_every=5", "federation.n_clients=6", "federation.clients_per_round=3",
    "federation.local_steps=2", "federation.batch_size=10", "data.options.d=6", "data.options.p=2",
    "data.options.records_per_client=40", "privacy.noise_seed=1", "run.seed=0", "privacy.epsilon=null", "privacy.sigma=0.5",
    "monitoring.progress=false", "--quiet",
]
