"""``shardwise.estimate``: what fits (memory) and what it costs (time), before any device is touched.

- ``memory``: the ZeRO paper's memory / communication arithmetic per stage, and the advice.
- ``report``: the estimate as text tables, and the model config's checks (the command line is
  ``shardwise.cli.estimate``).
- ``planner``: the step-time planner: which layout trains fastest on a given cluster.
- ``long_context``: the longest sequence in a memory budget under Ulysses SP and ALST tiling
  (``--budget`` turns it on).
"""

from __future__ import annotations

from shardwise.estimate.memory import (
    Candidate,
    Component,
    Estimate,
    ModelFacts,
    StageEstimate,
    count_params,
    estimate,
    model_facts,
    parse_bytes,
    parse_count,
)
from shardwise.estimate.planner import Cluster, Layout, Plan, format_plans, plan
from shardwise.estimate.report import format_report

__all__ = ["estimate", "model_facts", "count_params", "parse_count", "parse_bytes", "ModelFacts", "Estimate",
           "StageEstimate", "Candidate", "Component", "format_report", "plan", "format_plans", "Cluster",
           "Layout", "Plan"]
