"""Record-level differential privacy: the step mechanism, its accountants and the budget ledger.

* :mod:`rfedray.privacy.mechanism`: batch sampling and the privatised tangent gradient.
* :mod:`rfedray.privacy.randomness`: the ChaCha20 generator of every minibatch and noise draw.
* :mod:`rfedray.privacy.accountants`: epsilon of a client's transcript, calibration of sigma.
* :mod:`rfedray.privacy.ledger`: per-client budgets charged before every round.
* :mod:`rfedray.privacy.pld` and :mod:`rfedray.privacy.gdp`: the numerics behind the accountants.
* :mod:`rfedray.privacy.paper`: the paper's Table 10 and the clip that reproduces it.

The accountants never see the mechanism's code or data, only its public parameters.
"""
