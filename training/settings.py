"""Typed, frozen settings of a LoRA fine-tuning run, built once by the CLI (flags + environment,
``CHATPIPE_TRAIN_*``). The run's processes get them as a plain dict (``model_dump``) through
TorchDistributor's pickled arguments and rebuild them, so every process trains with the same values.

Defaults suit the default model (SmolLM2-135M-Instruct) on a few CPU cores: rank 16 on every linear
projection of the attention and the MLP, learning rate 2e-4 (LoRA tolerates ~10x a full fine-tune's),
3 epochs, one thread per process (processes, not threads, are what DDP scales).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The linear projections of a Llama-style block (SmolLM2's); a model with other names takes --target-modules.
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TrainSettings(BaseSettings):
    """One LoRA fine-tuning run: what it reads, how it trains, where it writes, how it is distributed."""

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_TRAIN_", frozen=True, extra="forbid")

    dataset: Path = Field(Path("datasets/ft"), description="The dataset job's output folder (sft/train.jsonl, "
                          "sft/validation.jsonl)")
    mode: Literal["sft", "dpo"] = Field("sft", description="sft: supervised on the assistant's answers of "
                                        "sft/*.jsonl; dpo: Direct Preference Optimization on preference/*.jsonl")
    dpo_beta: float = Field(0.1, gt=0, description="dpo: how far the adapter may move from the base model "
                            "(DPO's beta: larger keeps it closer)")
    model_path: Path | None = Field(None, description="Base model: a Hugging Face model folder; unset = the "
                                    "default model pulled by `chatpipe model pull`")
    runs_dir: Path = Field(Path(".chatpipe/runs"), description="Where each run's folder (checkpoints, adapter, "
                           "metrics) is made")
    run_name: str = Field("", description="The run folder's name; empty = lora-<UTC time>")
    # -- whose data, and the version it becomes
    tenant: str | None = Field(None, description="Train on this tenant's rows only: its adapter (one tenant's data "
                               "trains only that tenant's adapters)")
    shared_data: bool = Field(False, description="The dataset's tenants declared its data shared: one adapter "
                              "from every tenant's rows")
    publish: bool = Field(True, description="Publish the adapter as a model version (artifact store + chat.models); "
                          "needs the dataset job's output (its lineage) and the broker")
    model_name: str = Field("", description="The version's model name; empty = <tenant>-lora (shared-lora for "
                            "shared data)")
    artifact_store: str = Field(".chatpipe/models", description="Where versions' artifacts go: a folder, or any "
                                "fsspec URI (s3://bucket/models with s3fs installed)")
    eval_questions: tuple[Path, ...] = Field((), description="Question evals after training (repeat for several files): JSON lines "
                                             "{\"question\", \"expected\"}, asked of the base model and of the adapter "
                                             "(greedy; right = the answer contains expected); the shares are the "
                                             "version's eval results")
    # -- distribution
    processes: int = Field(1, ge=1, description="Data-parallel processes (DDP, gloo on CPU)")
    master: str = Field("local", description="local: TorchDistributor's local mode (processes on this machine); "
                        "spark://host:port: one process per Spark task on that cluster; session: the SparkSession "
                        "spark-submit made (training/submit.py in a SparkApplication)")
    threads_per_process: int = Field(1, ge=1, description="torch threads of each process")
    # -- LoRA
    lora_r: int = Field(16, ge=1, description="LoRA rank")
    lora_alpha: int = Field(32, ge=1, description="LoRA scale numerator (scale = alpha / r)")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input")
    target_modules: tuple[str, ...] = Field(LLAMA_PROJECTIONS, description="Module names that get adapters")
    # -- optimisation
    learning_rate: float = Field(2e-4, gt=0, description="AdamW peak learning rate (linear warmup, then linear decay)")
    warmup_steps: int = Field(5, ge=0, description="Steps of linear warmup")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    epochs: int = Field(3, ge=1, description="Passes over the training split")
    max_steps: int = Field(0, ge=0, description="Stop after this many optimizer steps; 0 = the epochs decide")
    batch_size: int = Field(4, ge=1, description="Examples per process per step (the global batch is this times processes)")
    max_seq_len: int = Field(512, ge=16, description="Longest example in tokens; a longer one loses its oldest "
                             "history (its answer is kept)")
    seed: int = Field(0, description="Seeds the adapter's initialisation, the data order and dropout")
    # -- checkpoints
    checkpoint_every: int = Field(50, ge=1, description="Save a checkpoint every this many steps (and at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept; older ones are removed")
    progress: bool = Field(True, description="Show a progress bar (loss, tokens/s, ETA)")

    @model_validator(mode="after")
    def _check(self) -> "TrainSettings":
        if self.master not in ("local", "session") and not self.master.startswith("spark://"):
            raise ValueError(f"master must be 'local', spark://host:port or 'session', not {self.master!r}")
        return self

    @property
    def local(self) -> bool:
        return self.master == "local"
