"""The in-process federated simulator: clients, local training, the round loop, run files."""
