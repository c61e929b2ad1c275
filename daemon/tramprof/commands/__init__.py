"""Commands: the CLI (``cli``) and what each subcommand runs — the daemon
(``run``), a one-shot profile (``record``), host and process checks
(``doctor``) — with the process-level concerns they share: capabilities
(``privileges``) and systemd's notification protocol (``sdnotify``)."""
