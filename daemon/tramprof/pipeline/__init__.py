"""The pipeline: drives sample -> unwind -> symbolize -> count for ``run``,
``record`` and ``doctor`` (``profiler``), names the frames of one sample
(``frames``) and keeps the numbers exporters read (``stats``)."""
