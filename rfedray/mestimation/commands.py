"""Command line of the Euclidean systems (added to ``rfedray`` through :func:`register`)::

    rfedray mestimation run [CONFIG] [key=value ...] [--engine local|ray]
    rfedray ddpsa run [CONFIG] [key=value ...] [--engine local|ray]
    rfedray ddpsa benchmark [--out DIR] [--scale tiny|full]

``run`` prints the run directory and writes ``config.yaml``, ``metrics.jsonl``, ``summary.json`` and
``model_final.pt`` there (:class:`rfedray.federated.rundir.RunDirectory`).
"""

from __future__ import annotations

import argparse
import json
import sys


def _build_task(cfg):
    """The run's dataset, model and engine: every client in this process, or on ``run.num_hosts``
    client actors that build their clients' data themselves (:func:`actors.engine.ray_task_engine`)."""
    from rfedray.federated.engine import LocalEngine, TaskSpec
    from rfedray.mestimation.config import DATA_MODULES, MODEL_MODULES

    spec = TaskSpec(DATA_MODULES[cfg.data.name], MODEL_MODULES[cfg.model.name], dict(cfg.data.options),
                    dict(cfg.model.options), cfg.federation.n_clients, cfg.run.seed)
    dataset = spec.build_dataset()
    model = spec.build_model(dataset.info)
    if cfg.run.engine == "local":
        return dataset, model, LocalEngine(dataset, model)
    from actors.engine import ray_task_engine

    return dataset, model, ray_task_engine(spec, cfg.federation.n_clients, cfg.run.num_hosts)


def _run_directory(cfg):
    from rfedray.config import to_yaml
    from rfedray.federated.rundir import RunDirectory, new_run_id

    rd = RunDirectory.create(cfg.run.output_dir, new_run_id(cfg.run.name))
    rd.write_bytes("config.yaml", to_yaml(cfg).encode())
    print(rd.path, flush=True)
    return rd


def _finish(rd, result: dict) -> None:
    for record in result["history"]:
        rd.append_metrics(record)
    rd.write_model(result["theta"])
    rd.write_json("summary.json", result["summary"])
    print(json.dumps(result["summary"]["final_metrics"]), file=sys.stderr)


def build_strategy(s):
    """The strategy object of a ``strategy`` config section."""
    from rfedray.mestimation.strategies import FedAvg, FedHybrid, FedNewton, FedSGD

    if s.name == "fedsgd":
        return FedSGD(s.lr)
    if s.name == "fedavg":
        return FedAvg(s.local_steps, s.local_lr)
    if s.name == "fedhybrid":
        return FedHybrid(FedAvg(s.local_steps, s.local_lr), FedSGD(s.lr), s.switch_round)
    return FedNewton(s.newton_steps, s.hessian_clip, s.damping, s.floor)


def build_policy(d, clip: float):
    """The clipping policy of a ``ddpsa`` config section."""
    from rfedray.ddpsa.mechanism import MedianClip, PrivateQuantileClip, StaticClip

    if d.clipping == "static":
        return StaticClip(clip)
    if d.clipping == "median":
        return MedianClip()
    return PrivateQuantileClip(initial_clip=clip, target_quantile=d.target_quantile, learning_rate=d.quantile_lr,
                               budget_share=d.budget_share)


def cmd_mestimation_run(args: argparse.Namespace) -> int:
    from rfedray.config import split_items
    from rfedray.mestimation.config import MEstimationConfig, load
    from rfedray.mestimation.runner import PrivacySpec, run_strategy

    path, overrides = split_items(args.items)
    cfg = load(MEstimationConfig, path, overrides + ([f"run.engine={args.engine}"] if args.engine else []))
    p = cfg.privacy
    privacy = PrivacySpec(p.epsilon, p.delta, p.clip, p.noise_multiplier, noise_seed=p.noise_seed) if p.enabled else PrivacySpec(clip=p.clip)
    rd = _run_directory(cfg)
    dataset, model, engine = _build_task(cfg)
    try:
        result = run_strategy(build_strategy(cfg.strategy), engine, model, dataset, rounds=cfg.run.rounds,
                              clients_per_round=cfg.federation.clients_per_round, batch_size=cfg.federation.batch_size,
                              privacy=privacy, seed=cfg.run.seed)
    finally:
        engine.close()
    _finish(rd, result)
    return 0


def cmd_ddpsa_run(args: argparse.Namespace) -> int:
    from rfedray.config import split_items
    from rfedray.ddpsa.runner import run_ddpsa
    from rfedray.ddpsa.secure_aggregation import FixedPointCodec, LocalAggregators
    from rfedray.mestimation.config import DDPSAConfig, load

    path, overrides = split_items(args.items)
    cfg = load(DDPSAConfig, path, overrides + ([f"run.engine={args.engine}"] if args.engine else []))
    d, p = cfg.ddpsa, cfg.privacy
    rd = _run_directory(cfg)
    dataset, model, engine = _build_task(cfg)
    if cfg.run.engine == "ray":
        from actors.aggregators import RayAggregators

        aggregators = RayAggregators(d.aggregators, d.min_clients)
    else:
        aggregators = LocalAggregators(d.aggregators, d.min_clients)
    try:
        result = run_ddpsa(
            build_policy(d, p.clip), engine, aggregators, model, dataset, rounds=cfg.run.rounds,
            clients_per_round=cfg.federation.clients_per_round, batch_size=cfg.federation.batch_size, lr=d.lr,
            epsilon=p.epsilon if p.enabled else None, delta=p.delta,
            noise_multiplier=p.noise_multiplier if p.enabled else None,
            codec=FixedPointCodec(d.frac_bits, max(1024, cfg.federation.n_clients)), min_clients=d.min_clients,
            patience=d.patience, min_delta=d.min_delta, seed=cfg.run.seed, noise_seed=p.noise_seed)
    finally:
        if hasattr(aggregators, "close"):
            aggregators.close()
        engine.close()  # last: it shuts down the Ray instance it started
    _finish(rd, result)
    return 0


def cmd_ddpsa_benchmark(args: argparse.Namespace) -> int:
    from rfedray.ddpsa.benchmark import run_benchmark

    result = run_benchmark(args.out, scale=args.scale)
    print(json.dumps(result["claims"], indent=2))
    return 0


def _run_parser(sub, name: str, helptext: str, func) -> None:
    system = sub.add_parser(name, help=helptext, description=helptext)
    actions = system.add_subparsers(dest=f"{name}_command", metavar="ACTION", required=True)
    run = actions.add_parser("run", help="run one configuration and write a run directory")
    run.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]",
                     help=f"a YAML config (configs/{name}_*.yaml) and dotlist overrides")
    run.add_argument("--engine", choices=("local", "ray"), help="override run.engine")
    run.set_defaults(func=func)
    return actions


def register(subparsers) -> None:
    """Add ``mestimation`` and ``ddpsa`` to the ``rfedray`` command line."""
    _run_parser(subparsers, "mestimation", "private federated M-estimation (FedSGD, FedAvg, FedHybrid, FedNewton)",
                cmd_mestimation_run)
    actions = _run_parser(subparsers, "ddpsa", "DDP-SA(-adaptive): Laplace DP with secure aggregation",
                          cmd_ddpsa_run)
    bench = actions.add_parser("benchmark", help="adaptive vs static clipping on the regression tasks")
    bench.add_argument("--out", default="runs/ddpsa-benchmark", help="output directory")
    bench.add_argument("--scale", choices=("tiny", "full"), default="tiny")
    bench.set_defaults(func=cmd_ddpsa_benchmark)
