"""The message broker part: the Celery app, task and queue names, wake-ups and consumers
(`app.py`), and the embedded `filesystem://` transport (`fs_transport.py`). The broker only
wakes processes up; every decision is in the store."""
