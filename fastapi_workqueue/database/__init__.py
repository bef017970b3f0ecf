"""The database transports: PostgreSQL (asyncpg), SQLite (aiosqlite) and SQL Server (aioodbc).

Nothing here knows FastAPI. A caller's SQLAlchemy session is accepted for publishing inside the
caller's transaction.
"""

from .factory import create_database_transport

__all__ = ["create_database_transport"]
