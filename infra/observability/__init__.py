"""The observability backends of the local stack: a trace store with a UI (Jaeger) and a metrics store
(Prometheus) that ``chatpipe up --observability`` runs beside the services.

Neither is on a registry this project reaches as a program, so both are built once from their Go source
on the Go module proxy, their UIs with npm (``binaries``), and cached outside the clone like the Kafka
jars. ``backends`` says how each runs as a service of the stack: command line, generated config, health,
address, the scrape targets. The stack (``infra.stack``) starts and stops them through its supervisor
like every other service.

Not here: the spans and metrics themselves (``transport.spans``, each service's ``metrics.py``), and the
Grafana dashboards (``infra/grafana/*.json``, for users who run Grafana; it is not shipped).
"""
