"""The emulated multi-node cluster: network namespaces, shaped links, CPU quotas, SLURM daemons
(see ``experiments/cluster/__init__.py`` for the files)."""
