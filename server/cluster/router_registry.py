"""The request router each deployment has in this process, for the ingress to read replicas and stats.

Ray Serve ships a custom router class by value (cloudpickle), so the router module's own globals are
copies in every process; this module is imported by reference, so its registry is the one that counts.
"""

from typing import Any

_ROUTERS: dict[tuple[str, str], Any] = {}  # (app, deployment) -> the router of this process


def register(app_name: str, deployment_name: str, router: Any) -> None:
    _ROUTERS[(app_name, deployment_name)] = router


def lookup(app_name: str, deployment_name: str) -> Any | None:
    """The router this process uses for the deployment (it exists once the handle has routed a call)."""
    return _ROUTERS.get((app_name, deployment_name))
