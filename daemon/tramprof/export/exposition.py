"""The body of a ``/metrics`` answer: prometheus-client's text or OpenMetrics
encoder, with the samples of the stack and function families written from
label text kept from one scrape to the next.

prometheus-client checks and escapes every label name and value of every
sample at every scrape, and the families' samples were made for it first:
at 10,000 series its body took 59 ms (text) and 89 ms (OpenMetrics), 13 and
14 ms written here. A series' labels never change while it lives, so their
text is rendered once (``LabelTexts``) and only the value is written at each
scrape. Everything else, the families' HELP and TYPE lines
included, is the library's own output; any format or name escaping other
than the two in use (names as they are, or underscores for invalid ones:
ours are all valid) is left to the library whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import cast

from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# The library's float format (Go's), typed.
_go_float = cast(Callable[[float], str], floatToGoString)
# prometheus-client before 0.22 had no name escaping: names stay as they are.
_PLAIN_ESCAPINGS = frozenset({"underscores", "allow-utf-8", None})
_EOF = b"# EOF\n"

LabelValues = tuple[str, ...]


def escape_label_value(value: str) -> str:
    """As both formats escape a label value: backslash, newline, double quote."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class LabelTexts:
    """The label text (``a="x",b="y"``, names sorted, as the library writes
    them) of label values, kept for the values asked for since the last
    ``forget_unused``: a family's live series."""

    def __init__(self, names: Sequence[str]) -> None:
        self._order = sorted(range(len(names)), key=names.__getitem__)
        self._names = [names[at] for at in self._order]
        self._kept: dict[LabelValues, str] = {}
        self._used: dict[LabelValues, str] = {}

    def text(self, values: LabelValues) -> str:
        text = self._kept.get(values)
        if text is None:
            text = ",".join(f'{name}="{escape_label_value(values[at])}"'
                            for name, at in zip(self._names, self._order, strict=True))
        self._used[values] = text
        return text

    def forget_unused(self) -> None:
        """Keep only the texts asked for since the last call (series that
        expired are not asked for again)."""
        self._kept, self._used = self._used, {}

    def __len__(self) -> int:
        return len(self._kept)


class RenderedCounter(Metric):
    """A counter family whose sample lines are written as its samples are
    added (``add``). Its ``samples`` are made only when read (by any other
    reader than ``encode``): making them took a third of a scrape."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str],
                 texts: LabelTexts) -> None:
        self._labels = tuple(labels)
        self._added: list[tuple[LabelValues, float]] = []
        super().__init__(name, documentation, "counter")
        self._texts = texts
        self._sample_name = f"{self.name}_total"
        self.lines: list[str] = []

    @property  # type: ignore[override]
    def samples(self) -> list[Sample]:
        if self._added:
            names, name = self._labels, self._sample_name
            self._samples.extend(Sample(name, dict(zip(names, values, strict=True)), value)
                                 for values, value in self._added)
            self._added = []
        return self._samples

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        self._samples, self._added = samples, []

    def add(self, values: LabelValues, value: float) -> None:
        self._added.append((values, value))
        # A whole count under 10**6 is written as the library writes it
        # (floatToGoString: repr of the float); anything else by the library.
        written = (f"{value}.0" if type(value) is int and 0 <= value < 1_000_000
                   else _go_float(value))
        self.lines.append(f"{self._sample_name}{{{self._texts.text(values)}}} {written}\n")

    def header(self) -> Metric:
        """The family without samples: the library writes its HELP and TYPE."""
        return Metric(self.name, self.documentation, "counter")


class _Fixed(Collector):
    """Metrics already collected, for an encoder."""

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self._metrics = list(metrics)

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)


def _escaping(encoder: Callable[..., bytes]) -> str | None:
    if isinstance(encoder, partial):
        return encoder.keywords.get("escaping")
    return None  # the library's default: underscores, or none before 0.22


def encode(source: Collector, accept: str) -> tuple[bytes, str]:
    """``source``'s metrics in the format ``accept`` asks for, and its
    content type (``prometheus_client.exposition.choose_encoder``)."""
    encoder, content_type = choose_encoder(accept)
    if _escaping(encoder) not in _PLAIN_ESCAPINGS:
        return encoder(source), content_type
    metrics = list(source.collect())
    rendered = [m for m in metrics if isinstance(m, RenderedCounter)]
    body = encoder(_Fixed(m for m in metrics if not isinstance(m, RenderedCounter)))
    if not rendered:
        return body, content_type
    tail = b""
    if body.endswith(_EOF):  # OpenMetrics ends there
        body, tail = body[:-len(_EOF)], _EOF
    parts = [body]
    for family in rendered:
        head = encoder(_Fixed([family.header()]))
        parts.append(head.removesuffix(_EOF))
        parts.append("".join(family.lines).encode())
    parts.append(tail)
    return b"".join(parts), content_type
