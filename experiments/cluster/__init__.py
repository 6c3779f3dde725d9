"""Where a spec runs.

profile.py    cluster profiles (experiments/clusters/*.yaml): local, slurm, emulated
hardware.py   hardware profiles (experiments/hardware/*.yaml): accelerator rates, link classes
slurm.py      the SLURM job template (real and emulated clusters); jobs.py: a job's own results folder
report.py     measured vs predicted time ratios of an emulated run; __main__.py: the CLI
emulator/     the emulated multi-node cluster on this machine:
  emulated.py   one cluster for one run: up, launches, record info, tear-down
  netns.py      its namespaces (fabric, head, one per node, one per rank); rankexec.py: a rank enters its own
  shaping.py    tc/HTB per rank and link class; emulation.py: the scaling rule and the compute calibration
  selftest.py   measure each link class (a rank's fixed CPU share: experiments/harness/cpuquota.py)
  slurmd.py     munge, slurmctld and slurmd inside the namespaces
"""
