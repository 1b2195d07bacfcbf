"""proxy/: the edge, the routes, auth and quotas, the dashboard."""
