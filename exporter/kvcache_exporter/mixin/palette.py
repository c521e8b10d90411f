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

# The causes only the live attribution names (the analyzer's traces have no token content or groups):
# layout problems in reds, the window setting orange, the hit unit yellow, isolation by design green.
LIVE_CAUSE_COLORS = {
    "history_rewritten": "#bf1b00",
    "content_moved": "#f29191",
    "window_expired": "#f9934e",
    "below_hit_unit": "#cca300",
    "identity_isolated": "#629e51",
}
