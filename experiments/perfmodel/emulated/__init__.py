"""The performance model of the emulated cluster: this machine's CPU ranks as the model sees them.

The hardware cost model (``perfmodel/costs.py``) holds only what an accelerator's profile says. An
emulated run's CPU ranks cost more than their kernels and transfers, and those terms live here:

* ``costs.EmulatedCosts``: compute from a kernel table timed on this machine under the run's CPU
  cap, plus the host's work per op and each transfer's overlap excess, through the two hooks the
  schedules call on every cost model (``CostModel.op_seconds``, ``CostModel.sender_seconds``);
* ``measured``: the kernel table (``kernel_times.json``) and its timing;
* ``excess``: the overlap excess fitted to the overlap probe (``overlap_probe.json``);
* ``message``: what a small blocking message holds its rank for, fitted to the message probe
  (``message_probe.json``), in place of the excess up to the sizes it measured;
* ``host_cost``: the host's work per op, from the per-call CPU (``call_cpu.json``);
* ``hardware``: this machine as the emulated cluster (links as the emulator shaped them);
* ``cfs``: a rank's compute under its CPU cgroup's quota, as a fluid (opt-in: ``history --cfs``);
* ``validate``: predicted / measured per case of an emulated run (``emulation_report.txt``).
"""
