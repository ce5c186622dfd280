"""Who is making a change: a user, a worker token, or the system itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class WorkerCaller(Protocol):
    """A request's caller that is a worker token, not a person (teams' ``WorkerPrincipal``
    says so by subclassing this). Core code that must tell the two apart, such as the
    throttles, checks this instead of importing teams, which builds on core."""

    @property
    def worker_token_prefix(self) -> str:
        """The token's public prefix: what its rate limit and audit label key on."""
        ...


@dataclass(frozen=True)
class Actor:
    user: Any = None
    token_prefix: str | None = None
    label: str = "system"

    @classmethod
    def of_user(cls, user: Any) -> Actor:
        return cls(user=user, label=getattr(user, "username", str(user)))

    @classmethod
    def of_worker(cls, token_prefix: str, worker_id: str = "") -> Actor:
        label = f"worker:{token_prefix}" + (f"/{worker_id}" if worker_id else "")
        return cls(token_prefix=token_prefix, label=label[:200])

    @classmethod
    def system(cls) -> Actor:
        return cls()
