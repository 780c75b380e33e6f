"""The LoRA training run on Kubernetes: a ``SparkApplication`` (Spark operator) whose driver runs
``spark-submit training/submit.py`` and whose executors are the training processes (TorchDistributor's
barrier tasks, DDP over gloo), one per executor.

Why a SparkApplication and not a PyTorchJob (Kubeflow's training operator): the trainer is started by
TorchDistributor on Spark (issue 41: distributed on an existing engine), the same code as
``chatpipe train lora --master spark://...``; the Spark operator is already what runs the dataset job here,
so a cluster needs one operator for both.

On demand, like the jobs' runs (``train-run.yaml``, outside the kustomization: each apply starts a run).
The executors share the datasets volume (the dataset read, the run folder written: checkpoints of every
process) and read the base model from the model volume; both must be mountable by pods on several nodes
(ReadWriteMany). The artifact store is a folder on the datasets volume unless ``training.artifact_store``
names a bucket (an fsspec URI; its credentials through ``training.env``).
"""

from __future__ import annotations

from typing import Any

from k8s.common import check_env, env_list, env_of, kafka_env, labels, meta, name, volume_source
from k8s.services import DATASETS_MOUNT
from k8s.spark import API, SERVICE_ACCOUNT, _volumes, packages
from k8s.values import Values

RUNS_DIR = f"{DATASETS_MOUNT}/_training/runs"
ARTIFACTS = f"{DATASETS_MOUNT}/_training/models"


def base_model_path(values: Values) -> str:
    from inference.engine.settings import EngineSettings

    if values.model.path:
        return f"{values.model.mount_path.rstrip('/')}/{values.model.path}"
    return str(EngineSettings(model_cache=values.model.mount_path).default_model_dir())


def train_env(values: Values) -> dict[str, str]:
    from spark_jobs.settings import SparkSettings
    from training.settings import TrainSettings
    from transport.settings import KafkaSettings

    t = values.training
    env = {**kafka_env(values, "jobs"), **env_of(SparkSettings, progress=False),
           **env_of(TrainSettings, dataset=f"{DATASETS_MOUNT}/finetune-dataset", model_path=base_model_path(values),
                    runs_dir=RUNS_DIR, artifact_store=t.artifact_store or ARTIFACTS, processes=t.processes,
                    tenant=t.tenant, shared_data=t.shared_data or None, model_name=t.model_name or None,
                    progress=False),
           **t.env}
    check_env(env, [KafkaSettings, SparkSettings, TrainSettings], "training")
    return env


def application(values: Values) -> dict[str, Any]:
    from spark_jobs.jars import spark_version

    sv, t = values.spark, values.training
    vols, mounts = _volumes(values)
    vols.append(volume_source(values.model.volume, "model", read_only=values.model.volume.kind == "pvc"))
    mounts.append({"name": "model", "mountPath": values.model.mount_path, "readOnly": True})
    env = env_list(train_env(values))
    pod_labels = labels("train-lora", "training")
    spec = {
        "type": "Python", "pythonVersion": "3", "mode": "cluster", "image": sv.image,
        "imagePullPolicy": values.image_pull_policy,
        "mainApplicationFile": f"local://{sv.app_dir.rstrip('/')}/training/submit.py",
        "sparkVersion": spark_version(),
        # one barrier task per executor, each a training process with the executor's cores as its threads
        "sparkConf": {"spark.jars.ivy": "/tmp/.ivy2", "spark.task.cpus": str(t.executor_cores)},
        "restartPolicy": {"type": "Never"},  # a failed run is resumed by a person (--resume), not retried blind
        "driver": {"cores": 1, "memory": sv.driver_memory, "serviceAccount": SERVICE_ACCOUNT,
                   "labels": pod_labels, "env": env, "volumeMounts": mounts},
        "executor": {"instances": t.processes, "cores": t.executor_cores, "memory": t.executor_memory,
                     "labels": pod_labels, "env": env, "volumeMounts": mounts},
        "volumes": vols,
        "deps": {"jars": list(sv.jars)} if sv.jars else {"packages": packages(values)},
        **({"imagePullSecrets": list(values.image_pull_secrets)} if values.image_pull_secrets else {}),
    }
    return {"apiVersion": API, "kind": "SparkApplication", "metadata": meta(values, name("train-lora-run"), "training"),
            "spec": spec}


def render(values: Values) -> list[dict[str, Any]]:
    if not values.training.enabled or not values.spark.enabled or values.spark.schedule_with != "operator":
        return []
    return [application(values)]
