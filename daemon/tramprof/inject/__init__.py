"""Turn trampolines on inside a running CPython (``tramprof inject``).

CPython 3.14+ is asked through its own remote-execution protocol (PEP 768,
``pep768``); 3.9-3.13 get one pending call scheduled by a short ptrace stop
of one thread (``hijack``). Either way the activation itself runs inside the
target, on a thread holding the GIL, at a point where the interpreter is
ready for it (``script``). ``injector`` runs the steps; ``target`` decides
whether a process may be injected at all; ``files`` places what the target
must open in its own root; ``policy`` is the daemon's automatic use of it.
"""
