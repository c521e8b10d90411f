"""Panel and query helpers shared by every dashboard.

Queries are built from selectors whose label matchers follow the metric's labels in the
exporter's catalog, so a panel can only filter on labels the series really has. Every
panel's description lists the metrics its queries read (parsed from the queries, so it
cannot go stale) and links to the runbook sections of the alerts it helps to answer.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import NamedTuple

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm
from grafana_foundation_sdk.models import units

from kvcache_exporter.catalog import BY_NAME
from kvcache_exporter.mixin.thresholds import DashboardThresholds

TAGS = ["kvcache", "vllm", "generated"]
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
METRIC_RE = re.compile(r"([A-Za-z_:][\w:]*)\{")


# Set by render.render() around each build, as kubernetes-mixin's $._config reaches every panel.
LIMITS: ContextVar[DashboardThresholds] = ContextVar("limits")


def limits() -> DashboardThresholds:
    return LIMITS.get()


# Series the exporter serves carry job/instance of the exporter's scrape. vLLM's own series come
# from vLLM's job: the sidecar's host with vLLM's port, so they follow $job/$instance through
# $host (the host part of the selected exporter instances).
_TARGET = ('job=~"$job"', 'instance=~"$instance"')
_VLLM_TARGET = ('instance=~"$host:[0-9]+"',)
_LABEL_VARS = ("model_name", "engine")
TOKENS_PER_SECOND = "suffix: tokens/s"
BATCHES_PER_SECOND = "suffix: batches/s"
WINDOW = 'window=~"$window"'


def sel(metric: str, *matchers: str) -> str:
    """`metric{...}` filtered by the dashboard variables that apply to it, plus `matchers`."""
    if metric.startswith("vllm:"):
        labels, base = _LABEL_VARS, _VLLM_TARGET
    else:  # the exporter's series, and Prometheus' own `up`
        labels, base = (BY_NAME[metric].labels if metric in BY_NAME else ()), _TARGET
    own = tuple(f'{label}=~"${label}"' for label in _LABEL_VARS if label in labels)
    if _per_engine(metric):
        own += (ENGINE_KIND,)
    return f"{metric}{{{', '.join((*base, *own, *matchers))}}}"


# SGLang targets' series carry engine_kind="sglang"; vLLM's carry none (the empty value: `^$`).
ENGINE_KIND = 'engine_kind=~"$engine_kind"'


def _per_engine(metric: str) -> bool:
    spec = BY_NAME.get(metric)
    return spec is not None and spec.per_target and not metric.startswith("kvcache_exporter_")


def rate(metric: str, by: str = "model_name", *matchers: str) -> str:
    return f"sum by ({by}) (rate({sel(metric, *matchers)}[{RATE}]))"


def ratio(numerator: str, denominator: str) -> str:
    """numerator / denominator, with no series (rather than NaN or +Inf) where the denominator is 0."""
    return f"({numerator}) / (({denominator}) > 0)"


class Query(NamedTuple):
    expr: str
    legend: str = ""
    instant: bool = False
    unit: str | None = None  # this query's unit where the panel mixes units (a rate beside a gauge)


def metrics_of(expr: str) -> list[str]:
    return sorted(set(METRIC_RE.findall(expr)))


def runbook_link(alert: str | None = None) -> db.DashboardLink:
    base = limits().runbook_url
    url = f"{base}#{alert.lower()}" if alert else base
    return db.DashboardLink(f"Runbook: {alert}" if alert else "Runbook").url(url).target_blank(True)


def _describe(shows: str, action: str, queries: tuple[Query, ...]) -> str:
    names = sorted({m for q in queries for m in metrics_of(q.expr)})
    reads = ", ".join(f"`{m}`" for m in names)
    return f"{shows}\n\nReads: {reads}.\n\nWhen it looks wrong: {action}"


def _thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=v, color=c) for v, c in steps])
    )


def below_is_bad(limit: float) -> db.ThresholdsConfig:
    return _thresholds((None, "red"), (limit, "green"))


def above_is_bad(limit: float) -> db.ThresholdsConfig:
    return _thresholds((None, "green"), (limit, "red"))


def _finish(builder, title, queries, shows, action, alerts, unit, w, h, thresholds, as_table=False):
    builder = (
        builder.title(title)
        .description(_describe(shows, action, queries))
        .datasource(DATASOURCE)
        .unit(unit)
        .span(w)
        .height(h)
        .links([runbook_link(a) for a in alerts] or [runbook_link()])
    )
    for i, q in enumerate(queries):
        target = prometheus.Dataquery().expr(q.expr).legend_format(q.legend or "__auto")
        target = target.ref_id(chr(ord("A") + i)).datasource(DATASOURCE)
        if as_table:
            target = target.format(pm.PromQueryFormat.TABLE)
        builder = builder.with_target(target.instant() if q.instant else target.range())
        if q.unit:
            builder = builder.override_by_query(chr(ord("A") + i), [dm.DynamicConfigValue("unit", q.unit)])
    return builder.thresholds(thresholds) if thresholds else builder


def graph(
    title: str,
    *queries: Query,
    shows: str,
    action: str,
    alerts: tuple[str, ...] = (),
    unit: str = units.Short,
    w: int = 12,
    h: int = 8,
    thresholds: db.ThresholdsConfig | None = None,
    stacked: bool = False,
    min_zero: bool = True,
    colors: dict[str, str] | None = None,
) -> timeseries.Panel:
    """A time series; `colors`: a fixed colour per series name (the miss causes' palette)."""
    panel = timeseries.Panel().legend(
        cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE).placement(cm.LegendPlacement.BOTTOM)
        .calcs(["lastNotNull", "max"]).show_legend(True)
    )  # fmt: skip
    if thresholds:
        panel = panel.thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)
        )
    if stacked:
        panel = panel.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL)).fill_opacity(30)
    if min_zero:
        panel = panel.min(0)
    for name, color in (colors or {}).items():
        fixed = dm.DynamicConfigValue("color", {"mode": "fixed", "fixedColor": color})
        panel = panel.override_by_name(name, [fixed])
    return _finish(panel, title, queries, shows, action, alerts, unit, w, h, thresholds)


def single(
    title: str,
    *queries: Query,
    shows: str,
    action: str,
    alerts: tuple[str, ...] = (),
    unit: str = units.Short,
    w: int = 4,
    h: int = 4,
    thresholds: db.ThresholdsConfig | None = None,
    named: bool = False,
) -> stat.Panel:
    """A stat; `named`: each value with its series' legend (what it is matters as much as how much)."""
    panel = stat.Panel().graph_mode(cm.BigValueGraphMode.AREA).color_mode(cm.BigValueColorMode.VALUE)
    if named:
        panel = panel.text_mode(cm.BigValueTextMode.VALUE_AND_NAME)
    panel = panel.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]))
    return _finish(panel, title, queries, shows, action, alerts, unit, w, h, thresholds)


def grid(
    title: str,
    *queries: Query,
    shows: str,
    action: str,
    alerts: tuple[str, ...] = (),
    w: int = 12,
    h: int = 8,
    value_text: dict[str, tuple[str, str]] | None = None,
) -> table.Panel:
    """A table of instant queries; `value_text` maps values to (text, color)."""
    panel = table.Panel()
    if value_text:
        options = {v: dm.ValueMappingResult(text=t, color=c) for v, (t, c) in value_text.items()}
        panel = panel.mappings([dm.ValueMap(options=options)])
    queries = tuple(q._replace(instant=True) for q in queries)
    return _finish(panel, title, queries, shows, action, alerts, units.Short, w, h, None, as_table=True)


def variables() -> list[db.DatasourceVariable | db.QueryVariable | db.CustomVariable]:
    """datasource, job, instance (pod), its host (hidden: vLLM's series), model_name, engine, each
    narrowing the next, the engine kind (vLLM or SGLang), and the exporter's window for the windowed
    gauges."""
    build_info = "kvcache_exporter_build_info"
    config = 'kvcache_vllm_config_info{job=~"$job", instance=~"$instance"'
    return [
        db.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        _query_var("job", "Job", f'label_values({build_info}{{job!=""}}, job)'),
        _query_var("instance", "Instance (pod)", f'label_values({build_info}{{job=~"$job"}}, instance)'),
        _query_var(
            "host", "Host", f'label_values({build_info}{{job=~"$job", instance=~"$instance"}}, instance)'
        )
        .regex("/^(.*):[0-9]+$/")
        .hide(dm.VariableHide.HIDE_VARIABLE),
        _query_var("model_name", "Model", f"label_values({config}}}, model_name)"),
        _query_var("engine", "Engine", f'label_values({config}, model_name=~"$model_name"}}, engine)'),
        db.CustomVariable("engine_kind")
        .label("Engine kind")
        .values("vllm : ^$,sglang : sglang")
        .include_all(True)
        .all_value(".*")
        .multi(False)
        .current(dm.VariableOption(selected=True, text="All", value="$__all")),
        _query_var("window", "Window", 'label_values(kvcache_prefix_cache_hit_ratio{job=~"$job"}, window)')
        .multi(False)
        .include_all(False)
        .current(dm.VariableOption(selected=True, text="5m", value="5m")),
        # The exporter's --cost.currency (default USD), named in every cost panel's title.
        _query_var("currency", "Currency", f"label_values({COST_INFO}, currency)")
        .multi(False)
        .include_all(False)
        .current(dm.VariableOption(selected=True, text="USD", value="USD"))
        .hide(dm.VariableHide.HIDE_VARIABLE),
    ]


COST_INFO = 'kvcache_cost_info{job=~"$job", instance=~"$instance"}'


def _query_var(name: str, label: str, query: str) -> db.QueryVariable:
    return (
        db.QueryVariable(name)
        .label(label)
        .query(query)
        .datasource(DATASOURCE)
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dm.VariableOption(selected=True, text="All", value="$__all"))
    )


def dashboard(
    uid: str, title: str, description: str, rows: dict[str, list], extra_variables=()
) -> db.Dashboard:
    """A dashboard with the shared variables, links and tags, and `rows` of panels in order."""
    board = (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .refresh("30s")
        .time("now-1h", "now")
        .timezone(cm.TimeZoneBrowser)
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .editable()
        .link(
            db.DashboardLink("KV cache dashboards")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(["kvcache"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .link(runbook_link().type(dm.DashboardLinkType.LINK))
    )
    for variable in (*variables(), *extra_variables):
        board = board.with_variable(variable)
    for title, panels in rows.items():
        board = board.with_row(db.Row(title))
        for panel in panels:
            board = board.with_panel(panel)
    return board
