"""The machines the suite describes as data: hardware profiles (``hardware``: accelerators, links, NICs;
YAML in experiments/hardware/) and cluster profiles (``cluster``: nodes, ranks, how to launch; YAML in
experiments/clusters/). The bottom floor of ``experiments``: it imports nothing else of it."""
