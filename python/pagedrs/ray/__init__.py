"""pagedrs on Ray Serve: data-parallel engine replicas routed by what each replica's cache holds.

``build_app`` needs the ``ray`` extra (``pip install 'pagedrs[ray]'``); the routing decisions
(``routing``), the route key (``route_key``) and the ASGI relay (``asgi``) import without it.
"""

from __future__ import annotations

from pagedrs.ray.app import ROUTINGS, build_app

__all__ = ["ROUTINGS", "build_app"]
