"""A finished run becomes a model version: its artifacts in the store, its record on ``chat.models``.

The artifact folder (``schemas.models`` has its layout) is assembled in the run folder (``artifact/``)
and copied file by file to ``<store>/<name>/<version>/`` through fsspec, so the store is a local folder
here and any fsspec URI in a deployment (``s3://``, ``gs://``, a mounted volume) with the matching fsspec
package installed. Then the ``ModelVersion`` record (state CANDIDATE) is written and acknowledged.
The run folder keeps ``version.json`` (the key published): a run is published once.

Hashes: ``adapter_sha256`` is the SHA-256 of the adapter's weights file; ``base_model_sha256`` of the
base model's weight files (``*.safetensors``, else ``*.bin``) read in name order, so a version names the
exact base it must be loaded onto; ``dataset_manifest_id`` of the dataset's manifest file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from schemas.errors import ChatpipeError
from schemas.models import ADAPTER_DIR, ADAPTER_WEIGHTS, LINEAGE_FILE, model_key
from schemas.records import ModelVersion
from training.card import dataset_summary, write_card
from training.question_eval import QUESTION_EVALS, as_eval_results
from training.launch import VERSION_FILE
from training.lineage import Selection, selected_lineage
from training.settings import TrainSettings
from transport.artifacts import sha256_files

DATASET_MANIFEST = "_chatpipe_dataset.json"  # the dataset job's (spark_jobs/erasure.py MANIFEST)
#: TrainSettings fields a version records as its hyperparameters (JSON values); ``--rebuild`` trains with them.
RECORDED = ("mode", "dpo_beta", "dataset", "tenant", "shared_data", "model_name", "lora_r", "lora_alpha", "lora_dropout",
            "target_modules", "learning_rate", "warmup_steps", "weight_decay", "epochs", "max_steps", "batch_size",
            "max_seq_len", "seed", "processes", "eval_questions")


class PublishError(ChatpipeError):
    """A run that cannot become a model version (no lineage, a store that refuses the files)."""


def base_model_sha256(folder: Path) -> str:
    weights = sorted(Path(folder).glob("*.safetensors")) or sorted(Path(folder).glob("*.bin"))
    if not weights:
        raise PublishError(f"no weight files (*.safetensors, *.bin) in the base model folder {folder}")
    return sha256_files(weights)


def manifest_id(dataset: Path) -> str:
    path = Path(dataset) / DATASET_MANIFEST
    if not path.is_file():
        raise PublishError(f"no {DATASET_MANIFEST} in {dataset}: publish versions trained on the dataset job's "
                           "output only (its manifest is what the version's lineage points to)")
    return sha256_files([path])


def version_name(settings: TrainSettings, selection: Selection) -> str:
    return settings.model_name or f"{selection.tenant or 'shared'}-lora"


def hyperparameters(settings: TrainSettings) -> dict[str, str]:
    data = settings.model_dump(mode="json")
    return {k: json.dumps(data[k]) for k in RECORDED}


def recorded_settings(version: ModelVersion) -> dict[str, Any]:
    """The TrainSettings values a version recorded (``--rebuild`` trains with them)."""
    return {k: json.loads(v) for k, v in version.hyperparameters.items() if k in RECORDED}


def assemble(run: Path, settings: TrainSettings, selection: Selection, lineage: Any, metrics: dict[str, Any],
             name: str, version: int, base_sha256: str, manifest: str) -> Path:
    """The artifact folder in the run folder: adapter, card, loss curve, lineage of the trained rows."""
    import pyarrow.parquet as pq

    artifact = run / "artifact"
    if artifact.exists():
        shutil.rmtree(artifact)
    shutil.copytree(run / ADAPTER_DIR, artifact / ADAPTER_DIR)
    trained = selected_lineage(lineage, selection)
    pq.write_table(trained, artifact / LINEAGE_FILE)
    write_card(artifact, name=name, version=version, base_model=Path(settings.model_path).name,
               base_model_sha256=base_sha256, settings=settings.model_dump(mode="json"), metrics=metrics,
               dataset=dataset_summary(settings.dataset, manifest, selection, trained))
    return artifact


def upload(artifact: Path, store: str, name: str, version: int) -> str:
    """Copy the artifact folder to ``<store>/<name>/<version>``; returns that URI."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(store)
    target = f"{root.rstrip('/')}/{name}/{version}"
    if fs.exists(target):
        raise PublishError(f"{store}/{name}/{version} exists already in the artifact store: a version is written once")
    for path in sorted(p for p in artifact.rglob("*") if p.is_file()):
        remote = f"{target}/{path.relative_to(artifact).as_posix()}"
        fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(path), remote)
    return target if "://" not in store else f"{store.split('://', 1)[0]}://{target}"


def make_version(settings: TrainSettings, selection: Selection, metrics: dict[str, Any], artifact: Path,
                 uri: str, name: str, version: int, base_sha256: str, manifest: str,
                 state_reason: str | None = None) -> ModelVersion:
    return ModelVersion(
        name=name, version=version, base_model=Path(settings.model_path).name, base_model_sha256=base_sha256,
        adapter_uri=f"{uri}/{ADAPTER_DIR}", adapter_sha256=sha256_files([artifact / ADAPTER_DIR / ADAPTER_WEIGHTS]),
        card_uri=uri, lineage_uri=f"{uri}/{LINEAGE_FILE}", dataset_uri=str(Path(settings.dataset).resolve()),
        dataset_manifest_id=manifest, tenant=selection.tenant, data_tenants=selection.tenants,
        training_rows=len(selection.lines), hyperparameters=hyperparameters(settings.model_copy(update={"model_name": name})),
        train_loss=metrics.get("train_loss"), eval_loss=metrics.get("eval_loss"),
        eval_loss_before=metrics.get("eval_loss_before"), eval_results=as_eval_results(metrics.get(QUESTION_EVALS, {})),
        state_reason=state_reason)


def publish_run(run: Path, settings: TrainSettings, metrics: dict[str, Any], kafka: Any,
                state_reason: str | None = None) -> ModelVersion:
    """Assemble, upload and register a finished run; the version number is the name's next."""
    from training.lineage import SELECTION_FILE, read_lineage
    from training.tasks import task_for
    from transport.model_registry import next_version, publish_model_version, read_model_versions

    done = run / VERSION_FILE
    if done.is_file():
        raise PublishError(f"{run} was published already as {json.loads(done.read_text())['key']}")
    selection = Selection.read(run)
    if selection is None:
        raise PublishError(f"{run} has no {SELECTION_FILE}: it was not started to be published")
    name = version_name(settings, selection)
    version = next_version(read_model_versions(kafka), name)
    table = task_for(settings.mode, settings.dpo_beta).table
    base_sha256, manifest = base_model_sha256(settings.model_path), manifest_id(settings.dataset)
    artifact = assemble(run, settings, selection, read_lineage(settings.dataset, "train", table), metrics, name,
                        version, base_sha256, manifest)
    uri = upload(artifact, settings.artifact_store, name, version)
    record = make_version(settings, selection, metrics, artifact, uri, name, version, base_sha256, manifest,
                          state_reason)
    publish_model_version(kafka, record)
    done.write_text(json.dumps({"key": model_key(name, version), "uri": uri}))
    return record
