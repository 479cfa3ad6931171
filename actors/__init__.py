"""The Ray layer: client, server and accountant actors that distribute rfedray.federated."""
