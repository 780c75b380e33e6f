"""Capacity planning for chatpipe: a replay of a bursty day against KEDA's scaling rule, and a sizing model.

- ``traffic``: the bursty day (LMSYS-Chat-1M-shaped requests, a diurnal curve, Gamma inter-arrivals, bursts);
- ``keda``: KEDA's Kafka scaler and the Kubernetes HPA's rule (tolerance, stabilization, rate policies),
  as the controllers compute them;
- ``simulate``: inference workers with continuous batching (per-worker throughput as a function of
  running requests, measured by ``bench/``), partition or share intake, pod start, rebalances, drains;
- ``model``: partitions, brokers, streams workers, GPUs, Qdrant and archive bytes from users and messages;
- ``figures``: every measured figure those use, with the file and run it comes from;
- ``records``: encoded sizes of the pipeline's records (the real codec and the archive's deflate).

Pure Python (no Kafka, no torch); ``chatpipe capacity`` is its command (docs/deploy.md "Autoscaling",
"Capacity").
"""
