"""Private federated M-estimation (Auddy, Peng, Paul) on Euclidean models, local or on Ray."""
