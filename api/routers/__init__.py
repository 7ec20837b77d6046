"""Routes by area: jobs, what a running job feeds (metrics, logs, events), checkpoints,
workers, and health."""
