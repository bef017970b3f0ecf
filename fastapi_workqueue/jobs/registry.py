"""The jobs a queue knows, by name and by function."""

from __future__ import annotations

from typing import Any

from ..core.errors import ConfigurationError
from .definition import Job


class UnknownJob(LookupError):
    """A job that was never declared on this queue."""


class JobRegistry:
    """Declared jobs. A name is declared once."""

    def __init__(self) -> None:
        self._by_name: dict[str, Job] = {}
        self._by_func: dict[Any, Job] = {}

    def add(self, job: Job) -> None:
        existing = self._by_name.get(job.name)
        if existing is not None:
            raise ConfigurationError(
                f"job {job.name!r} is declared twice: by {_where(existing.func)} and by {_where(job.func)}; "
                "give one of them another name"
            )
        self._by_name[job.name] = job
        self._by_func[job.func] = job

    def remove(self, name: str) -> None:
        job = self._by_name.pop(name, None)
        if job is not None:
            self._by_func.pop(job.func, None)

    def find(self, name: str) -> Job | None:
        return self._by_name.get(name)

    def resolve(self, job: Any) -> Job:
        """The declared job for a job function, a :class:`Job` or a job name."""
        if isinstance(job, Job):
            found = self._by_name.get(job.name)
        elif isinstance(job, str):
            found = self._by_name.get(job)
        else:
            found = self._by_func.get(job)
        if found is None:
            what = job if isinstance(job, str) else _where(getattr(job, "func", job))
            raise UnknownJob(
                f"{what!r} is not a job of this queue: declare it with @queue.job('its.name', ...) on the "
                "WorkQueue you dispatch through, in a module that is imported before the dispatch"
            )
        return found

    def __iter__(self) -> Any:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def queues(self) -> set[str]:
        """The queues the declared jobs use."""
        return {job.policy.queue for job in self._by_name.values()}


def _where(func: Any) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"
