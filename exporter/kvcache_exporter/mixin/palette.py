"""One colour per miss cause, shared by the dashboards and the analyzer's HTML page (Grafana's classic
palette): a layout problem red, capacity orange, routing purple, restarts blue, cold grey, the hit
unit yellow."""

CAUSE_COLORS = {
    "prefix_diverged": "#e24d42",
    "evicted": "#ef843c",
    "other_replica": "#ba43a9",
    "restart": "#1f78c1",
    "cold": "#8e8e8e",
    "partial_block": "#eab839",
}
