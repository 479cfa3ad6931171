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


def cmd_run(args: argparse.Namespace) -> int:
    """``rfedray mestimation|ddpsa run``: the configuration, its run directory (``config.yaml``), the task
    on the configured engine (every client in this process, or on ``run.num_hosts`` client actors that
    build their clients' data themselves, :func:`actors.engine.ray_task_engine`), the run, its files."""
    from contextlib import ExitStack

    from rfedray.config import split_items, to_yaml
    from rfedray.federated.engine import LocalEngine, TaskSpec
    from rfedray.federated.rundir import RunDirectory, new_run_id
    from rfedray.mestimation import config

    path, overrides = split_items(args.items)
    cfg = config.load(getattr(config, args.schema), path, overrides + ([f"run.engine={args.engine}"] if args.engine else []))
    rd = RunDirectory.create(cfg.run.output_dir, new_run_id(cfg.run.name))
    rd.write_bytes("config.yaml", to_yaml(cfg).encode())
    print(rd.path, flush=True)
    spec = TaskSpec(config.DATA_MODULES[cfg.data.name], config.MODEL_MODULES[cfg.model.name], dict(cfg.data.options),
                    dict(cfg.model.options), cfg.federation.n_clients, cfg.run.seed)
    dataset = spec.build_dataset()
    model = spec.build_model(dataset.info)
    p, ray = cfg.privacy, cfg.run.engine == "ray"
    with ExitStack() as stack:
        if ray:
            from actors.engine import ray_task_engine

            engine = ray_task_engine(spec, cfg.federation.n_clients, cfg.run.num_hosts)
        else:
            engine = LocalEngine(dataset, model)
        stack.callback(engine.close)  # last: it shuts down the Ray instance it started
        result = args.system(cfg, engine, model, dataset, stack, ray, rounds=cfg.run.rounds,
                             clients_per_round=cfg.federation.clients_per_round, batch_size=cfg.federation.batch_size,
                             epsilon=p.epsilon if p.enabled else None, delta=p.delta,
                             noise_multiplier=p.noise_multiplier if p.enabled else None, seed=cfg.run.seed,
                             noise_seed=p.noise_seed)
    for record in result["history"]:
        rd.append_metrics(record)
    rd.write_model(result["theta"])
    rd.write_json("summary.json", result["summary"])
    print(json.dumps(result["summary"]["final_metrics"]), file=sys.stderr)
    return 0


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


def mestimation(cfg, engine, model, dataset, stack, ray: bool, **common) -> dict:
    """An M-estimation run of ``cfg`` (:func:`rfedray.mestimation.runner.run_strategy`)."""
    from rfedray.mestimation.runner import run_strategy

    return run_strategy(build_strategy(cfg.strategy), engine, model, dataset, clip=cfg.privacy.clip, **common)


def ddpsa(cfg, engine, model, dataset, stack, ray: bool, **common) -> dict:
    """A DDP-SA run of ``cfg`` (:func:`rfedray.ddpsa.runner.run_ddpsa`), its aggregators actors on Ray."""
    from rfedray.ddpsa.runner import run_ddpsa
    from rfedray.ddpsa.secure_aggregation import FixedPointCodec, LocalAggregators

    d = cfg.ddpsa
    if ray:
        from actors.aggregators import RayAggregators

        aggregators = RayAggregators(d.aggregators, d.min_clients)
        stack.callback(aggregators.close)
    else:
        aggregators = LocalAggregators(d.aggregators, d.min_clients)
    return run_ddpsa(build_policy(d, cfg.privacy.clip), engine, aggregators, model, dataset, lr=d.lr,
                     codec=FixedPointCodec(d.frac_bits, max(1024, cfg.federation.n_clients)),
                     min_clients=d.min_clients, patience=d.patience, min_delta=d.min_delta, **common)


def cmd_ddpsa_benchmark(args: argparse.Namespace) -> int:
    from rfedray.ddpsa.benchmark import run_benchmark

    result = run_benchmark(args.out, scale=args.scale)
    print(json.dumps(result["claims"], indent=2))
    return 0


def _run_parser(sub, name: str, helptext: str, schema: str, system):
    """``rfedray NAME run``: :func:`cmd_run` with the configuration ``schema`` (a class of
    :mod:`rfedray.mestimation.config`) and the ``system`` function that runs it."""
    actions = sub.add_parser(name, help=helptext, description=helptext).add_subparsers(dest=f"{name}_command", metavar="ACTION", required=True)
    run = actions.add_parser("run", help="run one configuration and write a run directory")
    run.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]",
                     help=f"a YAML config (configs/{name}_*.yaml) and dotlist overrides")
    run.add_argument("--engine", choices=("local", "ray"), help="override run.engine")
    run.set_defaults(func=cmd_run, schema=schema, system=system)
    return actions


def register(subparsers) -> None:
    """Add ``mestimation`` and ``ddpsa`` to the ``rfedray`` command line."""
    _run_parser(subparsers, "mestimation", "private federated M-estimation (FedSGD, FedAvg, FedHybrid, FedNewton)",
                "MEstimationConfig", mestimation)
    actions = _run_parser(subparsers, "ddpsa", "DDP-SA(-adaptive): Laplace DP with secure aggregation",
                          "DDPSAConfig", ddpsa)
    bench = actions.add_parser("benchmark", help="adaptive vs static clipping on the regression tasks")
    bench.add_argument("--out", default="runs/ddpsa-benchmark", help="output directory")
    bench.add_argument("--scale", choices=("tiny", "full"), default="tiny")
    bench.set_defaults(func=cmd_ddpsa_benchmark)
