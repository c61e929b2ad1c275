"""Export: everything that leaves the daemon. Metric families declared once
(``families``), the Prometheus collector (``collector``) and the stack and
function series under a budget (``series``), the store of recent profile
windows (``store``), every profile format (``formats``) and the HTTP server
(``http``)."""
