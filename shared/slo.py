"""Service-level objectives for one request: its time to first token, time per output token after it,
and end-to-end latency, each at most a number of ms (vLLM's `--goodput` spelling: `ttft:MS tpot:MS
e2el:MS`). The benchmark counts the requests that meet them (goodput); the server plans its step time
for them (`--slo`) and counts the requests that meet each one (`/metrics`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

OBJECTIVES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Slo:
    """The objectives a request must meet to count as good, in ms; None: not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: Sequence[str]) -> Slo:
        """`["ttft:2000", "tpot:100"]` (also `e2el:MS`), or one device's preset (`DEFAULT_SLOS`: `cpu`,
        `cuda`). ValueError naming the bad item."""
        if len(items) == 1 and items[0] in DEFAULT_SLOS:
            return DEFAULT_SLOS[items[0]]
        limits: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            field = f"{name}_ms"
            if not sep or name not in OBJECTIVES or field in limits:
                raise ValueError(
                    f"objective {item!r}: expected ttft:MS, tpot:MS or e2el:MS, each once, "
                    f"or one of {', '.join(DEFAULT_SLOS)}"
                )
            try:
                limits[field] = float(value)
            except ValueError:
                raise ValueError(f"objective {item!r}: {value!r} is not a number of ms") from None
            if not (math.isfinite(limits[field]) and limits[field] > 0):  # nan would silently meet nothing
                raise ValueError(f"objective {item!r}: the limit must be a finite number of ms > 0")
        if not limits:
            raise ValueError("an SLO needs at least one objective")
        return cls(**limits)

    def met(self, ttft_s: float, tpot_s: float | None, e2el_s: float) -> dict[str, bool]:
        """Whether a request with these times met each objective that is set (a one-token answer has no
        TPOT, and meets that objective, as in vLLM)."""
        times = {"ttft": ttft_s, "tpot": 0.0 if tpot_s is None else tpot_s, "e2el": e2el_s}
        return {name: times[name] * 1000.0 <= limit for name, limit in self.limits().items()}

    def limits(self) -> dict[str, float]:
        """The objectives that are set, by name, in ms."""
        return {name: limit for name in OBJECTIVES if (limit := getattr(self, f"{name}_ms")) is not None}

    def label(self) -> str:
        return " ".join(f"{name}:{limit:g}" for name, limit in self.limits().items())


# Per device, objectives for an interactive chat with a small model: the first token within a short
# wait and a stream that keeps moving (CPU: 4 tokens/s per stream, what 2 cores give 16-32 streams of the
# default model at the 300 ms step target; the objectives issue 30's runs were judged by; CUDA:
# DistServe's chatbot-like objectives). Pick your own for other workloads.
DEFAULT_SLOS = {"cpu": Slo(ttft_ms=5000.0, tpot_ms=250.0), "cuda": Slo(ttft_ms=500.0, tpot_ms=50.0)}
