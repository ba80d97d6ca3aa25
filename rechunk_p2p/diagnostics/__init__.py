"""Diagnostics: event-loop lag monitor and its report types.

Where it runs: the client (``measure_event_loops``); see the submodules for the probe
(event loop of each server) and the pure statistics.
"""

from rechunk_p2p.diagnostics.loop_monitor import LoopLagMonitor, measure_event_loops
from rechunk_p2p.diagnostics.loop_stats import DistributedSignals, LoopLagReport, LoopLagSummary

__all__ = [
    "DistributedSignals",
    "LoopLagMonitor",
    "LoopLagReport",
    "LoopLagSummary",
    "measure_event_loops",
]
