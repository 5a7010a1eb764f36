"""Serving an engine that lives on the ranks over the OpenAI HTTP API (``%colossal serve``,
``workbench serve``): routes in ``app.py``, request and response bodies in ``openai_api.py``,
the link to the ranks in ``bridge.py`` and ``rank_side.py``, the lifecycle in ``server.py``,
the plan ``workbench serve`` picks for a model folder in ``fit.py``."""

from workbench.serving.keys import api_key
from workbench.serving.server import Server, running_servers

__all__ = ["Server", "api_key", "running_servers"]
