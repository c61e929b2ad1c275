"""Sample: the BPF program's loader (``program``), the decoder of its counted
samples (``drain``), the writer of per-process unwinding state (``maps``),
the record layouts shared with ``bpf/tramprof.h`` (``layout``) and the
kernel's struct offsets (``btf``)."""
