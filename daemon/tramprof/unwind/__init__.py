"""Unwind: every way of recovering frames beyond the frame-pointer walk, behind
one protocol (``mode``), and the merge of all frames by stack address
(``merge``). One module per mode (``chain``, ``scan``), with their helpers:
the runtime descriptor reader (``descriptor``), the stub layout learnt from
bytes (``stub_layout``) and the one "is this address a stub" test (``arenas``).
"""
