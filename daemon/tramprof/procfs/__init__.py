"""Procfs: everything the daemon reads about a process from ``/proc``:
identity and status (``identity``), memory mappings (``maps``), memory (the
one reader, ``memory``), grouping metadata (``metadata``) and lifecycle
events (``events``: netlink connector, polling, and the table of processes
keyed by identity). Any process may exit between two reads: readers turn
that into ``model.ProcessGone``."""
