"""Everything that leaves the daemon: Prometheus metrics and the HTTP server."""
