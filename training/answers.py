"""Greedy answers of the base model, or of the base model with a run's adapter, to a list of questions:
what the planted-knowledge eval compares (``chatpipe.testing.planted_facts``, bench/train.py).

transformers' ``generate`` on the model peft builds, not the serving engine: the engine does not load
adapters yet (the next issue serves versions), and this checks the adapter exactly as it was saved.
"""

from __future__ import annotations

from pathlib import Path

import torch

from formats.chat_tokens import encode_chat


def answer_questions(base_model: Path, questions: list[str], adapter: Path | None = None,
                     max_new_tokens: int = 24) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base_model, local_files_only=True, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    answers = []
    with torch.no_grad():
        for question in questions:
            ids = encode_chat(tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True)
            prompt = torch.tensor([ids])
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id)
            answers.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).strip())
    return answers
