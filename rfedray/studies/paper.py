"""The paper's published numbers that the studies are compared with (from ``shared/seeds``).

Each value is copied from the tables of the paper's appendix; ``tests/test_studies.py`` checks
that every one of them appears in the seed document.
"""

EPSILONS = (0.5, 1, 2, 5, 10)

# Table 9: median cost of privacy at epsilon = 1 over 10 seeds, in units of 1e-4.
# (panel, d, p, d_M, D, k, eta*sigma^2*d_M/k, ProjAvg, RLAvg)
TABLE9 = (
    ("a", 40, 1, 39, 820, 10, 4.57, 1.24, 1.23),
    ("a", 40, 2, 76, 820, 10, 8.91, 2.43, 2.42),
    ("a", 40, 4, 144, 820, 10, 16.9, 4.18, 4.16),
    ("a", 40, 8, 256, 820, 10, 30.0, 7.56, 7.52),
    ("b", 26, 8, 144, 351, 10, 16.9, 4.02, 4.01),
)

# Table 10: noise level and median optimality gap over 10 seeds.
# epsilon -> (sigma ours, sigma PriRFed, gap ProjAvg, gap RLAvg, gap RetAvg, PriRFed eta, PriRFed gap)
TABLE10 = {
    0.5: (0.0452, 0.247, 1.5e-3, 1.5e-3, 1.5e-3, 0.05, 3.1e-2),
    1: (0.0242, 0.131, 4.4e-4, 4.4e-4, 4.4e-4, 0.1, 7.7e-3),
    2: (0.0132, 0.0710, 1.5e-4, 1.5e-4, 1.5e-4, 0.2, 3.9e-3),
    5: (0.00617, 0.0328, 4.9e-5, 4.9e-5, 4.9e-5, 0.2, 8.0e-4),
    10: (0.00368, 0.0193, 3.0e-5, 3.0e-5, 3.0e-5, 0.2, 2.9e-4),
}

# Table 4: common settings of the synthetic experiments.
TABLE4 = {"n": 50, "k": 10, "m": 5000, "tau": 10, "B": 500, "T": 200, "epsilon": 1, "delta": 1e-5, "eta": 0.2}

# Table 15: aggregation time per round (ms), median [IQR], and RetAvg / ProjAvg.
TABLE15 = {
    "BNCI2014_001": {"clients": 3, "projavg": 0.50, "rlavg": 0.71, "retavg": 4.47, "ratio": 9},
    "Weibo2014": {"clients": 5, "projavg": 0.67, "rlavg": 1.39, "retavg": 10.8, "ratio": 16},
    "Cho2017": {"clients": 26, "projavg": 1.61, "rlavg": 4.87, "retavg": 29.3, "ratio": 18},
}
