"""The plugin's state and the family watch's counters on sglang's Prometheus ``/metrics``.

Only where sglang's metrics are on: for ``--enable-metrics`` sglang sets PROMETHEUS_MULTIPROC_DIR
in the launch process before it starts the schedulers (0.5.14 entrypoints/engine.py:1270-1271,
utils/common.py:1550-1565), and serves ``/metrics`` from that directory through prometheus_client's
MultiProcessCollector (utils/common.py:1568-1578, entrypoints/http_server.py:270-271). There,
``plugin.register()`` adds an AFTER hook (``install``) on sglang's own scheduler collector,
``SchedulerMetricsCollector.log_stats`` (observability/metrics_collector.py, 0.5.11 onwards). sglang
calls it at its own cadence, in the schedulers that export their stats (attention TP rank 0, every
rank with ``--enable-metrics-for-all-schedulers``: metrics_collector.py:1040-1044): each prefill
batch, every ``decode_log_interval`` decode batches, every 30 s idle (scheduler_components/
metrics_reporter.py:565-637, 777-851, 1018-1059). So nothing runs per forward step, and a scheduler
that exports none of sglang's stats exports none of these either: absent, never a stale value
(``emit_constants``, which every scheduler calls once at start, is left alone for that reason).

Each call sets this process's series with that collector's own labels (``model_name``,
``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, ``dp_rank`` where set, sglang's extra
labels: metrics_collector.py:1051-1067), and writes only what changed since the last call:

- ``sglang:dsa_fix_member_state{member, state}``: 1 for the member's state token in this process
  (the vocabulary of ``status``: protected_by_plugin, affected, not_reachable, cannot_tell, ...),
  0 for each state it had before (so ``== 1`` selects the current one);
- with the family watch on (SGLANG_DSA_FIX_WATCH), per watched kind (``members.WatchKind.kind``,
  named by each member's unit): ``sglang:dsa_fix_watch_violations_total{kind}`` (rows or replays
  past the buffer), ``sglang:dsa_fix_watch_columns_past_end_total{kind}`` (row kinds: the columns
  written or read past the row end), ``sglang:dsa_fix_watch_checking{kind}`` (0 once the kind's
  check failed and switched off: its counts stop there, unknown rather than zero). Without the
  watch these series are absent, never zero.

prometheus_client is imported on the first call only (after sglang set the directory, as sglang
imports it); where it is missing nothing is exported, and the log says so once.
"""

from __future__ import annotations

import logging
import os
import pkgutil

from sglang_dsa_fix import watch

logger = logging.getLogger("sglang_dsa_fix")

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
COLLECTOR = "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector"
TARGETS = (f"{COLLECTOR}.log_stats",)

MEMBER_STATE = "sglang:dsa_fix_member_state"
WATCH_VIOLATIONS = "sglang:dsa_fix_watch_violations_total"
WATCH_COLUMNS = "sglang:dsa_fix_watch_columns_past_end_total"
WATCH_CHECKING = "sglang:dsa_fix_watch_checking"


def metrics_on() -> bool:
    """sglang's metrics are on in this process: the multiprocess directory it serves is set."""
    return bool(os.environ.get(MULTIPROC_DIR))


def install(registry, hook_type, member_states) -> list:
    """Where sglang's metrics are on, the AFTER hook on its collector (``registry``: sglang's
    HookRegistry); ``member_states()``: {member: state token}, as /server_info reports them.
    Returns the targets registered."""
    if not metrics_on():
        return []
    exporter = Exporter(member_states)

    def export_after(result, collector, *args, **kwargs):
        exporter.export(collector)

    registered = []
    for target in TARGETS:
        try:
            pkgutil.resolve_name(target)  # as HookRegistry resolves it when applying
            registry.register(target, export_after, hook_type.AFTER)
            registered.append(target)
        except Exception as exc:
            logger.warning(
                "sglang-dsa-fix: /metrics: cannot hook %s (%s: %s)", target, type(exc).__name__, exc
            )
    return registered


class Exporter:
    """This process's series: the metrics created on the first call, with the collector's label
    names; then each call writes only what changed."""

    def __init__(self, member_states):
        self._member_states = member_states
        self._metrics = None
        self._off = False
        self._states = {}  # member -> the state token exported as 1
        self._counted = {}  # (metric name, kind) -> the total exported so far
        self._checking = {}  # kind -> the value exported

    def export(self, collector) -> None:
        """Never raises into sglang: a failure logs one warning and stops the export."""
        if self._off:
            return
        try:
            labels = {name: str(value) for name, value in collector.labels.items()}
            if self._metrics is None:
                self._metrics = self._create(list(labels))
                if self._metrics is None:
                    self._off = True
                    return
            self._export_states(labels)
            self._export_watch(labels)
        except Exception as exc:
            self._off = True
            logger.warning("sglang-dsa-fix: /metrics export stopped (%s: %s)", type(exc).__name__, exc)

    @staticmethod
    def _create(label_names: list):
        try:
            from prometheus_client import Counter, Gauge
        except ImportError as exc:
            logger.warning("sglang-dsa-fix: nothing on /metrics: prometheus_client missing (%s)", exc)
            return None
        # multiprocess_mode as sglang's gauges: the most recent value of each series.
        return {
            MEMBER_STATE: Gauge(
                MEMBER_STATE,
                "sglang-dsa-fix: 1 for the member's state token in this scheduler, 0 for earlier ones.",
                [*label_names, "member", "state"],
                multiprocess_mode="mostrecent",
            ),
            WATCH_VIOLATIONS: Counter(
                WATCH_VIOLATIONS,
                "sglang-dsa-fix watch: rows or CUDA-graph replays past their buffer, per kind.",
                [*label_names, "kind"],
            ),
            WATCH_COLUMNS: Counter(
                WATCH_COLUMNS,
                "sglang-dsa-fix watch: req_to_token columns written or read past the row end, per kind.",
                [*label_names, "kind"],
            ),
            WATCH_CHECKING: Gauge(
                WATCH_CHECKING,
                "sglang-dsa-fix watch: 1 while the kind's check runs, 0 once it failed and stopped.",
                [*label_names, "kind"],
                multiprocess_mode="mostrecent",
            ),
        }

    def _export_states(self, labels: dict) -> None:
        gauge = self._metrics[MEMBER_STATE]
        for member, state in self._member_states().items():
            before = self._states.get(member)
            if before == state:
                continue
            if before is not None:
                gauge.labels(**labels, member=member, state=before).set(0)
            gauge.labels(**labels, member=member, state=state).set(1)
            self._states[member] = state

    def _export_watch(self, labels: dict) -> None:
        for kind, (violations, columns, checking) in watch.by_kind(read_without_waiting).items():
            self._add(WATCH_VIOLATIONS, labels, kind, violations)
            if columns is not None:
                self._add(WATCH_COLUMNS, labels, kind, columns)
            if self._checking.get(kind) != checking:
                self._metrics[WATCH_CHECKING].labels(**labels, kind=kind).set(int(checking))
                self._checking[kind] = checking

    def _add(self, name: str, labels: dict, kind: str, total: int) -> None:
        """The counter raised to the watch's total (the series appears at 0 on the first call)."""
        before = self._counted.get((name, kind))
        if before is None or total > before:
            self._metrics[name].labels(**labels, kind=kind).inc(total - (before or 0))
            self._counted[name, kind] = total


_COPIES: dict = {}  # CUDA device -> [pinned host copy, its event or None, the last finished copy's values]


def read_without_waiting(device, counters) -> list:
    """The watch's device counters as of the last copy that finished, never waiting on the device
    (``log_stats`` runs in the scheduler loop, where a host sync would stall the overlap): each call
    reads the copy the previous one started once its event says it is done, and starts the next
    (one at a time; zeros until the first is done). CPU counters are read as they are."""
    if device.type != "cuda":
        return counters.tolist()
    import torch

    entry = _COPIES.get(device)
    if entry is None:
        host = torch.zeros(counters.shape, dtype=counters.dtype, pin_memory=True)
        entry = _COPIES[device] = [host, None, host.tolist()]
    host, event, _ = entry
    if event is not None and event.query():  # query() never blocks
        entry[1:] = None, host.tolist()
    if entry[1] is None:
        # On the current stream: not ordered after the watch's launches on a forward stream, so
        # a copy may miss the last few increments; a later one has them (the counts only grow).
        with torch.cuda.device(device):
            host.copy_(counters, non_blocking=True)
            entry[1] = torch.cuda.Event()
            entry[1].record()
    return entry[2]
