"""The dataset card: what went in, what each step dropped and why, what came out.

Written as ``dataset_card.json`` (machine-readable) and ``dataset_card.md`` (the same facts
for people). It holds only facts that follow from the input and the settings (no wall
times, no hostnames), so a rerun writes the same card; timings are printed by the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HIST_EDGES = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def bucket_label(i: int) -> str:
    lo = HIST_EDGES[i]
    return f"{lo}-{HIST_EDGES[i + 1] - 1}" if i + 1 < len(HIST_EDGES) else f">={lo}"


@dataclass
class Card:
    settings: dict
    input: dict = field(default_factory=dict)            # records read per topic, schema versions
    steps: list[dict] = field(default_factory=list)      # {step, input, kept, dropped}
    drops: dict[str, dict[str, int]] = field(default_factory=dict)  # step -> reason -> count
    pii: dict[str, int] = field(default_factory=dict)    # kind -> placeholders written
    outputs: dict[str, int] = field(default_factory=dict)
    histograms: dict[str, dict[str, int]] = field(default_factory=dict)
    # deletions read, undecodable; turns and feedback left out for erasure (spark_jobs.deletions)
    erasure: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"settings": self.settings, "input": self.input, "steps": self.steps,
                "drops": self.drops, "erasure": self.erasure, "pii_redactions": self.pii, "outputs": self.outputs,
                "length_histograms_tokens": self.histograms}

    def to_markdown(self) -> str:
        s = self.settings
        out = ["# Dataset card: chatpipe fine-tuning dataset", "",
               "SFT examples in OpenAI chat format and preference pairs (OpenAI DPO format) built from",
               f"`{s.get('turns_topic')}` and `{s.get('feedback_topic')}` by `chatpipe job finetune-dataset`.", "",
               "## Input", ""]
        out += [f"- {k}: {v}" for k, v in self.input.items()]
        out += ["", "## Steps", "", "| step | input | kept | dropped |", "|---|---:|---:|---:|"]
        out += [f"| {st['step']} | {st['input']} | {st['kept']} | {st['dropped']} |" for st in self.steps]
        out += ["", "## Drop reasons", "", "| step | reason | records |", "|---|---|---:|"]
        for step, reasons in self.drops.items():
            out += [f"| {step} | {r} | {n} |" for r, n in sorted(reasons.items())]
        def table(title: str, head: str, counts: dict, intro: tuple[str, ...] = ()) -> list[str]:
            return ["", f"## {title}", "", *intro, f"| {head} |", "|---|---:|", *(f"| {k} | {v} |" for k, v in counts.items())]

        out += table("Erasure", "what | records", self.erasure,
                     ("Records of erased users and conversations (chat.deletions), in no output.", ""))
        out += table("PII redactions", "kind | placeholders", self.pii)
        out += table("Outputs", "file | records", self.outputs)
        for name, hist in self.histograms.items():
            out += table(f"Length histogram: {name} (estimated tokens)", "tokens | examples", hist)
        out += ["", "## Settings", "", "```json"]
        import json

        out += [json.dumps(s, indent=2, sort_keys=True), "```", ""]
        return "\n".join(out)
