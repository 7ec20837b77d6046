"""The scheduler and the workers: Celery consumers that assign queued jobs, run the trainer
as a supervised subprocess, and record what it reports. Never imports the trainer's
training code (only `trainer.spec` and `trainer.exitcodes`, both torch-free)."""
