"""The Ray layer that distributes :mod:`rfedray.federated` (``run.engine: ray``).

* :mod:`actors.driver`: connects to (or starts) Ray and provides :func:`~actors.driver.ray_executor`;
  the driver process runs the federation loop itself and owns the run directory.
* :mod:`actors.client_actor`: client actors hosting sticky blocks of clients, and their placement.
* :mod:`actors.accountant_actor`: the accountant actor, every client's budget, persisted before each
  round trains.
"""
