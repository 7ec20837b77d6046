"""The store: data access over SQLAlchemy (PostgreSQL or SQLite); see docs/architecture.md."""
