"""Ray's own ``PrefixCacheAffinityRouter`` (from ``ray.llm``), for ``routing="ray-prefix"``.

The router is what Ray Serve LLM ships: a prefix tree of the prompt text each replica was
sent, prefix match when the replicas' queues are balanced, power of two choices otherwise.
It lives in ``ray.llm``, whose package imports need ``ray[llm]`` (vLLM); the router's own
module does not, so it is imported from there directly. It reads the text to match from
the request's first positional argument's ``prompt`` attribute: the ingress puts the
prompt's token ids there as one character each (``route_key.route_text``), since Ray's own
normalization turns a token-id prompt into an empty string. A request without a prompt
(``/v1/models``, ``/metrics``) has no text: routed by Ray's power of two choices, because
the stock router divides by the text's length and would fail on an empty one.
"""

from __future__ import annotations

from typing import Any, Optional

RAY_PREFIX_ROUTER = ("ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
                     ":PrefixCacheAffinityRouter")


def _stock_router() -> Any:
    import importlib

    module, name = RAY_PREFIX_ROUTER.split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:  # an older or newer Ray that moved it
        raise ImportError(f"routing='ray-prefix' needs Ray's PrefixCacheAffinityRouter ({RAY_PREFIX_ROUTER}), "
                          f"which this Ray does not have: {exc}") from exc


class RayPrefixRouter(_stock_router()):  # type: ignore[misc]
    """The stock router, given no text (not an empty one) for a request without a prompt."""

    def _extract_text_from_request(self, pending_request: Any) -> Optional[str]:
        for arg in pending_request.args or ():
            text = getattr(arg, "prompt", None)
            if isinstance(text, str):
                return text or None
        return None
