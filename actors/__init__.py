"""The Ray layer that distributes :mod:`rfedray.federated` (``run.engine: ray``).

* :mod:`actors.driver`: connects to (or starts) Ray, starts the server actor and follows its
  progress (the driver process); on a Ray instance it starts itself (one machine) it does the
  server's part itself (:func:`~actors.server_actor.serve`), ledger included; the clients are
  always on client actors (the server's process never holds a client's records).
* :mod:`actors.session`: this process's connection to Ray (a cluster, or a local instance).
* :mod:`actors.engine`: the Ray executor, a cohort's training on the client actors within the round
  deadline (:func:`~actors.engine.ray_executor`).
* :mod:`actors.server_actor`: the server actor, pinned to the driver's node: it runs the federation
  loop (cohorts, aggregation, evaluation, checkpoints), owns the run directory and exports the
  Prometheus metrics.
* :mod:`actors.client_actor`: client actors hosting sticky blocks of clients, and their placement.
* :mod:`actors.accountant_actor`: the accountant actor, every client's budget, persisted before each
  round trains.
"""
