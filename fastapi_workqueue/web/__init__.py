"""The FastAPI side: the dependency bridge for handlers, the routers, the request session."""
