"""The REST API (FastAPI): validates specs, writes intent to the store, reads the store."""
