"""Where a Spark job's time goes, from Spark's own event log (the UI is off in these jobs).

``event_log_conf(dir)`` gives the conf that makes Spark write its JSON event log there;
``summarise(dir)`` reads it back and returns per-job and per-stage wall time (submission ->
completion) with the stage's task time and shuffle bytes, the name Spark gave the stage (the
call site / operator) and its task count. Used by ``bench/finetune.py --stages``.
Not a product module: bench only.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path


def event_log_conf(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    return {"spark.eventLog.enabled": "true", "spark.eventLog.dir": folder.resolve().as_uri(),
            "spark.eventLog.compress": "false"}


@dataclass
class Stage:
    stage_id: int
    name: str
    tasks: int
    wall_s: float
    task_s: float
    cpu_s: float
    shuffle_read_mb: float
    shuffle_write_mb: float
    job_id: int | None = None


def summarise(folder: Path) -> tuple[list[tuple[int, float, str]], list[Stage]]:
    """(jobs as (id, wall s, description), stages) of the newest event log in ``folder``."""
    # Spark 4 writes a rolling log: a folder per application holding events_<n>_... files.
    newest = max(Path(folder).iterdir(), key=lambda p: p.stat().st_mtime)
    files = sorted((p for p in newest.iterdir() if p.name.startswith("events_")),
                   key=lambda p: int(p.name.split("_")[1])) if newest.is_dir() else [newest]
    stages: dict[int, Stage] = {}
    # per stage: task ms, executor CPU ns, shuffle bytes read, shuffle bytes written
    totals: dict[int, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    stage_job: dict[int, int] = {}
    job_start: dict[int, tuple[int, str]] = {}
    jobs = []
    for line in (ln for f in files for ln in f.read_text().splitlines()):
        ev = json.loads(line)
        kind = ev.get("Event")
        if kind == "SparkListenerJobStart":
            desc = (ev.get("Properties") or {}).get("callSite.short", "")
            job_start[ev["Job ID"]] = (ev["Submission Time"], desc)
            for sid in ev.get("Stage IDs", []):
                stage_job[sid] = ev["Job ID"]
        elif kind == "SparkListenerJobEnd":
            start, desc = job_start.get(ev["Job ID"], (ev["Completion Time"], ""))
            jobs.append((ev["Job ID"], (ev["Completion Time"] - start) / 1000, desc))
        elif kind == "SparkListenerTaskEnd":
            m, info, total = ev.get("Task Metrics") or {}, ev.get("Task Info") or {}, totals[ev["Stage ID"]]
            total[0] += info.get("Finish Time", 0) - info.get("Launch Time", 0)
            total[1] += m.get("Executor CPU Time", 0)
            total[2] += sum((m.get("Shuffle Read Metrics") or {}).get(k, 0) for k in ("Remote Bytes Read", "Local Bytes Read"))
            total[3] += (m.get("Shuffle Write Metrics") or {}).get("Shuffle Bytes Written", 0)
        elif kind == "SparkListenerStageCompleted":
            info = ev["Stage Info"]
            sid = info["Stage ID"]
            wall = (info.get("Completion Time", 0) - info.get("Submission Time", 0)) / 1000
            ops = sorted({json.loads(r.get("Scope") or "{}").get("name", "") for r in info.get("RDD Info", [])}
                         - {"", "map", "mapPartitions", "mapPartitionsInternal", "AdaptiveSparkPlan", "Project"})
            name = " ".join(o for o in ops if not o.startswith("WholeStageCodegen")) or info["Stage Name"]
            stages[sid] = Stage(sid, name, info["Number of Tasks"], wall, 0, 0, 0, 0)
    for sid, st in stages.items():
        task_ms, cpu_ns, read, written = totals[sid]
        st.task_s, st.cpu_s, st.shuffle_read_mb, st.shuffle_write_mb = task_ms / 1000, cpu_ns / 1e9, read / 1e6, written / 1e6
        st.job_id = stage_job.get(sid)
    return sorted(jobs), sorted(stages.values(), key=lambda s: s.stage_id)


def report(folder: Path, top: int = 15) -> str:
    jobs, stages = summarise(folder)
    lines = [f"spark jobs: {len(jobs)}, total job wall {sum(j[1] for j in jobs):.1f} s; stages: {len(stages)}"]
    lines += [f"  job {jid:3d} {wall:7.2f} s  {desc}" for jid, wall, desc in sorted(jobs, key=lambda j: -j[1])[:top]]
    lines.append(f"executor cpu {sum(s.cpu_s for s in stages):.1f} s in tasks {sum(s.task_s for s in stages):.1f} s")
    lines.append("costliest stages by executor cpu (wall s, task s, cpu s, tasks, shuffle read/write MB, operators):")
    lines += [f"  stage {st.stage_id:3d} (job {st.job_id}) {st.wall_s:7.2f} {st.task_s:7.2f} {st.cpu_s:7.2f} "
              f"{st.tasks:4d} {st.shuffle_read_mb:7.1f} {st.shuffle_write_mb:7.1f}  {st.name}"
              for st in sorted(stages, key=lambda s: -s.cpu_s)[:top]]
    return "\n".join(lines)
