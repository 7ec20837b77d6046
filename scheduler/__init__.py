"""The scheduler part: which queued job runs on which idle workers, and why the others
wait. `policy.py` decides (pure: gang picking, placement, backfill and reservation,
pending reasons; `fairshare.py` and `preemption.py` the pool's order and its victims);
`cycle.py` runs one pass against the store (`store/queue.py` reads and writes);
`sweeps.py` is the sweep controller over `space.py`'s search spaces. `process.py` is the
scheduler process (wake-ups, ticks, the reaper, the reconciler, the claim deadline) and
`cli.py` its command, `torchyard scheduler`. Of ours, this part imports `torchyard.store`,
`torchyard.broker` (the process only), `torchyard.contracts` and `torchyard.settings`;
never the API or the worker."""
