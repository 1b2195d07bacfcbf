"""The proxy's HTTP routes, one module per resource. Each is a module-level function that takes
the typed `Services` (proxy/services.py); the completion routes are answered by the edge
(proxy/edge.py) through `completions.complete`, the rest through FastAPI routers.
"""
