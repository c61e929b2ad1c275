"""BPF C sources, shipped as package data and compiled by bcc at start-up."""
