"""The Spark jobs (``chatpipe job finetune-dataset``, ``chatpipe job usage-report``) on Kubernetes, two ways:

- with the Spark operator (kubeflow/spark-operator, ``sparkoperator.k8s.io/v1beta2``): a
  ``ScheduledSparkApplication`` per job (driver and executors are pods of the Spark image, the job file
  run by spark-submit as ``spark-submit spark_jobs/<job>.py``), and a ``SparkApplication`` per job for a
  run on demand (``spark-run.yaml``, applied by hand: outside the kustomization, so that an apply of the
  deployment does not start a run);
- as a ``CronJob`` running ``chatpipe job <job>`` in one pod (``local[*]``: the driver runs the tasks),
  which needs nothing but the chatpipe image.

The jobs' arguments are their real flags (``spark_jobs.cli_args.job_options``), the connectors those
``spark_jobs.jars`` fetches for the installed pyspark, the Kafka connection the ``chatpipe-jobs`` user's
(``KafkaSettings`` variables: the jobs take their security settings from the environment only).
"""

from __future__ import annotations

from typing import Any

from k8s.common import (check_env, container_security, env_list, env_of, kafka_env, kafka_volumes, labels,
                              meta, name, pod_spec_common, resources, volume_source)
from k8s.services import ARCHIVE_MOUNT, DATASETS_MOUNT
from k8s.values import Values

API = "sparkoperator.k8s.io/v1beta2"
SERVICE_ACCOUNT = name("spark")


def jobs():
    """(job name, settings class, module) of each batch job."""
    from spark_jobs.settings import FinetuneSettings, UsageReportSettings
    from spark_jobs.shipping import JOB_MODULES

    classes = {"finetune-dataset": FinetuneSettings, "usage-report": UsageReportSettings}
    return [(job, classes[job], module) for job, module in JOB_MODULES.items()]


def job_args(values: Values, job: str, job_cls) -> list[str]:
    """The job's flags: output folder (replaced by each run), source, archive folder."""
    from spark_jobs.cli_args import job_options

    flag = {o.field: o.flag for o in job_options(job_cls)}
    args = [flag["out"], f"{DATASETS_MOUNT}/{job}", flag["overwrite"], flag["source"], values.spark.source]
    if values.spark.source == "archive":
        args += [flag["archive_dir"], ARCHIVE_MOUNT]
    return args


def job_env(values: Values) -> dict[str, str]:
    from spark_jobs.settings import DatasetStoreSettings, FinetuneSettings, SparkSettings, UsageReportSettings
    from transport.settings import KafkaSettings

    env = {**kafka_env(values, "jobs"), **env_of(SparkSettings, progress=False),
           **env_of(DatasetStoreSettings, root=DATASETS_MOUNT)}
    check_env(env, [KafkaSettings, SparkSettings, DatasetStoreSettings, FinetuneSettings, UsageReportSettings],
              "spark jobs")
    return env


def packages(values: Values) -> list[str]:
    """Maven coordinates of the connectors for spark-submit (their own dependencies come along)."""
    if values.spark.packages is not None:
        return list(values.spark.packages)
    from spark_jobs.jars import ARTIFACTS, spark_version

    return [f"org.apache.spark:{a}:{spark_version()}" for a in ARTIFACTS if a.startswith("spark-")]


def _volumes(values: Values) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    vols = [volume_source(values.datasets, "datasets")]
    mounts = [{"name": "datasets", "mountPath": DATASETS_MOUNT}]
    if values.spark.source == "archive":
        vols.append(volume_source(values.archive, "archive", read_only=values.archive.kind == "pvc"))
        mounts.append({"name": "archive", "mountPath": ARCHIVE_MOUNT, "readOnly": True})
    kafka_vols, kafka_mounts = kafka_volumes(values, "jobs")
    return vols + kafka_vols, mounts + kafka_mounts


def application_spec(values: Values, job: str, job_cls, module: str) -> dict[str, Any]:
    from spark_jobs.jars import spark_version

    sv = values.spark
    vols, mounts = _volumes(values)
    env = env_list(job_env(values))
    pod_labels = labels(f"spark-{job}", "spark")
    return {
        "type": "Python", "pythonVersion": "3", "mode": "cluster", "image": sv.image,
        "imagePullPolicy": values.image_pull_policy,
        "mainApplicationFile": f"local://{sv.app_dir.rstrip('/')}/{module.replace('.', '/')}.py",
        "arguments": job_args(values, job, job_cls), "sparkVersion": spark_version(),
        "sparkConf": {"spark.jars.ivy": "/tmp/.ivy2"},  # the image's user may not write its home
        "restartPolicy": {"type": "OnFailure", "onFailureRetries": 2, "onFailureRetryInterval": 60,
                          "onSubmissionFailureRetries": 3, "onSubmissionFailureRetryInterval": 60},
        "driver": {"cores": sv.driver_cores, "memory": sv.driver_memory, "serviceAccount": SERVICE_ACCOUNT,
                   "labels": pod_labels, "env": env, "volumeMounts": mounts},
        "executor": {"instances": sv.executor_instances, "cores": sv.executor_cores, "memory": sv.executor_memory,
                     "labels": pod_labels, "env": env, "volumeMounts": mounts},
        "volumes": vols,
        "deps": {"jars": list(sv.jars)} if sv.jars else {"packages": packages(values)},
        **({"imagePullSecrets": list(values.image_pull_secrets)} if values.image_pull_secrets else {}),
    }


def scheduled(values: Values) -> list[dict[str, Any]]:
    return [{"apiVersion": API, "kind": "ScheduledSparkApplication",
             "metadata": meta(values, name(job), "spark"),
             "spec": {"schedule": values.spark.schedule, "concurrencyPolicy": "Forbid",
                      "successfulRunHistoryLimit": 3, "failedRunHistoryLimit": 3,
                      "template": application_spec(values, job, cls, module)}}
            for job, cls, module in jobs()]


def on_demand(values: Values) -> list[dict[str, Any]]:
    """One ``SparkApplication`` per job: ``kubectl create -f spark-run.yaml`` runs them once."""
    return [{"apiVersion": API, "kind": "SparkApplication", "metadata": meta(values, name(f"{job}-run"), "spark"),
             "spec": application_spec(values, job, cls, module)}
            for job, cls, module in jobs()]


def cronjobs(values: Values) -> list[dict[str, Any]]:
    vols, mounts = _volumes(values)
    out = []
    for job, cls, _ in jobs():
        container = {"name": "job", "image": values.image, "imagePullPolicy": values.image_pull_policy,
                     "command": ["chatpipe"], "args": ["job", job, *job_args(values, job, cls)],
                     "env": env_list(job_env(values)), "resources": resources(values.spark.cronjob_resources),
                     "securityContext": container_security(), "volumeMounts": mounts}
        pod = {**pod_spec_common(values), "restartPolicy": "OnFailure", "containers": [container], "volumes": vols}
        out.append({"apiVersion": "batch/v1", "kind": "CronJob", "metadata": meta(values, name(job), "spark"),
                    "spec": {"schedule": values.spark.schedule, "concurrencyPolicy": "Forbid",
                             "successfulJobsHistoryLimit": 3, "failedJobsHistoryLimit": 3,
                             "jobTemplate": {"spec": {"backoffLimit": 2, "template": {
                                 "metadata": {"labels": labels(f"spark-{job}", "spark")}, "spec": pod}}}}})
    return out


def rbac(values: Values) -> list[dict[str, Any]]:
    """The driver's service account: it creates its executors' pods, a Service and ConfigMaps."""
    rules = [{"apiGroups": [""], "resources": ["pods", "services", "configmaps", "persistentvolumeclaims"],
              "verbs": ["create", "get", "list", "watch", "update", "patch", "delete", "deletecollection"]}]
    return [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(values, SERVICE_ACCOUNT, "spark")},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": meta(values, SERVICE_ACCOUNT, "spark"), "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": meta(values, SERVICE_ACCOUNT, "spark"),
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SERVICE_ACCOUNT},
             "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": values.namespace}]}]


def render(values: Values) -> list[dict[str, Any]]:
    if not values.spark.enabled:
        return []
    if values.spark.schedule_with == "cronjob":
        return cronjobs(values)
    return [*rbac(values), *scheduled(values)]
