"""Transport-neutral contracts and the consumer runtime.

Nothing in this package imports FastAPI, SQLAlchemy or a database driver.
"""
