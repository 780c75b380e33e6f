"""What ``chatpipe up --observability`` hands Jaeger and Prometheus (``infra.observability.backends``), what
every service of the stack gets for its spans, and the Grafana dashboards: plain logic and files, no
processes (tests/infra/test_observability_backends.py runs the real backends)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from infra.observability import backends, binaries
from infra.settings import StackSettings
from infra.stack import LocalStack, StackError

GRAFANA = Path(__file__).resolve().parents[2] / "infra" / "grafana"
# The metrics a dashboard may name: the worker's (vLLM's names, `chatpipe:` for `vllm:`) and the
# pipeline's consumer lag (inference/worker/metrics.py, streams).
KNOWN_METRICS = {
    "chatpipe:time_to_first_token_seconds", "chatpipe:inter_token_latency_seconds",
    "chatpipe:request_queue_time_seconds", "chatpipe:e2e_request_latency_seconds", "chatpipe:kv_cache_usage_perc",
    "chatpipe:prefix_cache_queries", "chatpipe:prefix_cache_hits", "chatpipe:num_requests_running",
    "chatpipe:num_requests_waiting", "chatpipe:generation_tokens", "chatpipe:prompt_tokens",
    "chatpipe_consumer_lag_records", "chatpipe_consumer_lag_seconds",
}


def _targets(config: dict) -> dict[str, list[tuple[str, str]]]:
    return {job["job_name"]: [(t, group["labels"]["service"]) for group in job["static_configs"]
                              for t in group["targets"]] for job in config["scrape_configs"]}


def test_generated_prometheus_yml_scrapes_every_service_of_the_stack(tmp_path):
    """Prometheus must scrape the gateway, each inference and streams worker on its own port (worker n on
    worker_metrics_port / streams_metrics_port + n - 1) and itself, each target named by its service; a count that
    changes rewrites the file (a running Prometheus is then sent SIGHUP), the same one does not."""
    settings = StackSettings(state_dir=tmp_path, gateway_port=8100, worker_metrics_port=9500,
                             inference_workers=3, streams_metrics_port=9600, streams_workers=2,
                             qdrant_url="http://127.0.0.1:6333", prometheus_port=9191, scrape_interval_s=2.5)
    assert backends.write_config(settings, backends.PROMETHEUS) is True
    path = tmp_path / "prometheus" / "prometheus.yml"
    config = yaml.safe_load(path.read_text())
    assert config["global"]["scrape_interval"] == "2.5s"
    targets = _targets(config)
    assert targets["gateway"] == [("127.0.0.1:8100", "gateway")]
    assert targets["inference"] == [("127.0.0.1:9500", "inference"), ("127.0.0.1:9501", "inference-2"),
                                    ("127.0.0.1:9502", "inference-3")]
    assert targets["streams"] == [("127.0.0.1:9600", "streams"), ("127.0.0.1:9601", "streams-2")]
    assert targets["prometheus"] == [("127.0.0.1:9191", "prometheus")]
    assert {job["metrics_path"] for job in config["scrape_configs"]} == {"/metrics"}
    assert backends.write_config(settings, backends.PROMETHEUS) is False  # unchanged: no reload
    fewer = settings.model_copy(update={"inference_workers": 1})
    assert backends.write_config(fewer, backends.PROMETHEUS) is True
    assert _targets(yaml.safe_load(path.read_text()))["inference"] == [("127.0.0.1:9500", "inference")]


def test_jaeger_config_takes_otlp_on_the_stack_ports_and_serves_the_built_ui(tmp_path):
    """The services post spans to the OTLP/HTTP port in their environment, so Jaeger must listen exactly
    there; the UI's assets are served only when they were built (else Jaeger's placeholder page)."""
    settings = StackSettings(state_dir=tmp_path, otlp_grpc_port=14317, otlp_http_port=14318, jaeger_port=26686,
                             jaeger_grpc_port=26685)
    config = backends.jaeger_config(settings, None)
    assert config["receivers"]["otlp"]["protocols"] == {"grpc": {"endpoint": "127.0.0.1:14317"},
                                                        "http": {"endpoint": "127.0.0.1:14318"}}
    query = config["extensions"]["jaeger_query"]
    assert query["http"] == {"endpoint": "127.0.0.1:26686"} and "ui" not in query
    assert query["enable_tracing"] is False  # else it exports its own spans to localhost:4317, 10 s stops
    assert backends.otlp_endpoint(settings) == "http://127.0.0.1:14318"
    ui = tmp_path / "ui"
    with_ui = backends.jaeger_config(settings, ui)["extensions"]["jaeger_query"]["ui"]
    assert with_ui == {"assets_path": str(ui)}
    assert yaml.safe_load(backends.to_yaml(config)) == config  # the emitter writes what it was given


def test_every_service_gets_a_trace_folder_and_the_otlp_endpoint_only_with_observability(tmp_path, monkeypatch):
    """Spans always land in <state>/traces; only a stack that runs Jaeger may point the services at it (an
    endpoint nobody listens on would only fail every export). A value set for `up` wins."""
    monkeypatch.delenv("CHATPIPE_TRACING_FILE_DIR", raising=False)
    monkeypatch.delenv("CHATPIPE_TRACING_OTLP_ENDPOINT", raising=False)
    plain = LocalStack(StackSettings(state_dir=tmp_path))
    assert plain.names == ("kafka", "redis", "streams", "inference", "gateway")
    env = plain._service_spec("gateway").env
    assert env["CHATPIPE_TRACING_FILE_DIR"] == str(tmp_path.resolve() / "traces")
    assert "CHATPIPE_TRACING_OTLP_ENDPOINT" not in env
    observed = LocalStack(StackSettings(state_dir=tmp_path, observability=True, otlp_http_port=14318))
    assert observed.names == ("kafka", "jaeger", "prometheus", "redis", "streams", "inference", "gateway")
    for name in ("streams", "inference", "gateway"):
        assert observed._service_spec(name).env["CHATPIPE_TRACING_OTLP_ENDPOINT"] == "http://127.0.0.1:14318"
    monkeypatch.setenv("CHATPIPE_TRACING_FILE_DIR", "/elsewhere")
    assert observed.service_env("gateway").get("CHATPIPE_TRACING_FILE_DIR") is None  # up's own value stays
    assert observed._service_spec("gateway").env["CHATPIPE_TRACING_FILE_DIR"] == "/elsewhere"


def test_backends_are_asked_for_only_with_observability(tmp_path):
    """`--only jaeger` on a stack without --observability would start nothing and say nothing."""
    with pytest.raises(StackError, match="--only kafka,jaeger: jaeger and prometheus run with --observability"):
        LocalStack(StackSettings(state_dir=tmp_path)).up(["kafka", "jaeger"])
    assert not (tmp_path / "kafka").exists()  # refused before the broker was prepared


def test_a_missing_go_is_one_line_naming_it_and_leaves_no_half_build(tmp_path):
    """A user without Go must read what to install (or which variable to set), not a traceback; and the
    cache must not keep a folder that a later run could take for a finished build."""
    settings = StackSettings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", go="no-such-go")
    with pytest.raises(binaries.BuildError) as exc:
        binaries.ensure_program(settings, binaries.JAEGER)
    assert "Go ('no-such-go') not found" in str(exc.value) and "CHATPIPE_GO" in str(exc.value)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "cache" / "bin" / f"jaeger-{binaries.JAEGER.version}").exists()
    with pytest.raises(binaries.BuildError, match="not built in .*`chatpipe up --observability` builds it"):
        binaries.installed(settings)


def test_a_failed_build_step_is_named_and_its_folder_removed(tmp_path):
    """A build that fails half-way (here: `go` is `false`) must leave nothing that reads as done."""
    settings = StackSettings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", go="false")
    with pytest.raises(binaries.BuildError, match=r"`.*false mod init .*` failed \(exit 1\)"):
        binaries.ensure_program(settings, binaries.PROMETHEUS)
    left = sorted(p.name for p in (tmp_path / "cache" / "bin").iterdir())
    assert left == [f".prometheus-{binaries.PROMETHEUS.version}.lock", f"prometheus-{binaries.PROMETHEUS.version}.build.log"]


_METRIC = re.compile(r"\bchatpipe[a-zA-Z0-9_:]*")


def _exprs(dashboard: dict) -> list[str]:
    panels = [*dashboard["panels"], *(p for row in dashboard["panels"] for p in row.get("panels", []))]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def test_grafana_dashboards_parse_and_query_only_metrics_the_services_export():
    """A dashboard that names a metric nobody exports shows an empty panel and no error, so a renamed
    metric must fail here instead."""
    files = sorted(GRAFANA.glob("*.json"))
    assert files, f"no dashboard in {GRAFANA}"
    for path in files:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"]
        exprs = _exprs(dashboard)
        assert exprs, f"{path.name} queries nothing"
        for expr in exprs:
            named = {re.sub(r"_(bucket|count|sum|total)$", "", m) for m in _METRIC.findall(expr)}
            assert named, f"{path.name}: {expr!r} names no chatpipe metric"
            assert named <= KNOWN_METRICS, f"{path.name}: {expr!r} names {sorted(named - KNOWN_METRICS)}"


def test_jaeger_ui_assets_shipped_as_a_tarball_are_unpacked_once_into_the_cache(tmp_path):
    """Built UI assets can come as one file (jaeger-ui is on no registry here); a tarball that is not
    them must be refused without leaving a folder that reads as the UI."""
    import tarfile

    assets = tmp_path / "assets"
    (assets / "static").mkdir(parents=True)
    (assets / "index.html").write_text('<div id="jaeger-ui-root"></div>')
    good, bad = tmp_path / "ui.tar.xz", tmp_path / "bad.tar.gz"
    with tarfile.open(good, "w:xz") as tar:
        tar.add(assets, arcname=".")
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(assets / "static", arcname="static")
    cache = tmp_path / "cache"
    with pytest.raises(binaries.BuildError, match="has no index.html at its top"):
        binaries.ensure_jaeger_ui(StackSettings(state_dir=tmp_path, cache_dir=cache, jaeger_ui_source=bad))
    settings = StackSettings(state_dir=tmp_path, cache_dir=cache, jaeger_ui_source=good)
    assert not binaries.jaeger_ui_dir(settings).exists()
    ui = binaries.ensure_jaeger_ui(settings)
    assert ui == binaries.jaeger_ui_dir(settings) and (ui / "index.html").read_text().startswith("<div")
    good.unlink()  # from now on the cache is enough
    assert binaries.ensure_jaeger_ui(settings) == ui
