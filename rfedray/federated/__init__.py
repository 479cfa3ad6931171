"""federated package."""
