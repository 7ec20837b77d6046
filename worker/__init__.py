"""The workers: Celery consumers, one per GPU (or CPU slot), that claim the assignments
the scheduler (`torchyard.scheduler`) hands them, run the trainer as a supervised
subprocess, and record what it reports. Never imports the trainer's training code (only
the torch-free `torchyard.contracts`)."""
