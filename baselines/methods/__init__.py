"""One module per attention method (see ``baselines.registry``)."""
