"""DDP-SA(-adaptive): layer-wise Laplace DP with secret-shared secure aggregation."""
