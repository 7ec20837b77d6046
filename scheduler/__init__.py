"""The scheduler part: which queued job runs on which idle workers, and why the others
wait. `policy.py` decides (pure: gang picking, placement, backfill and reservation,
pending reasons); `cycle.py` runs one pass against the store (`store/queue.py` reads and
writes). The process that runs passes and sends the messages is `worker/scheduler.py`.
Of ours, this part imports `torchyard.store` and `torchyard.contracts.spec` only."""
