"""Loaders for external long-context data on local disk, into the task `Instance` structure.

* RULER-style generated JSONL (``{"index", "input", "outputs": [...], "answer_prefix"?, "length"?}``,
  as written by RULER's ``prepare.py``): the input is split at line boundaries into ``num_segments``
  segments of about equal size; metric ``all`` (RULER string_match_all).
* LongBench JSONL (``{"input", "context", "answers": [...], "dataset"?, "_id"?}``): the context is split
  into its ``Passage k:`` blocks when it has them (the multi-document QA sets), else at paragraphs into
  ``num_segments``; metric ``f1`` (max token F1 over the answers).

Given the model's tokenizer, a record is framed as one user turn of its chat template (when it has one):
the template's text before the user content opens the prefix, the text after it (through the generation
prompt) goes before the answer prefix (RULER ``answer_prefix``; ``Answer:`` for LongBench), as
`jaxkv.eval.realtext` frames its tasks. Without a tokenizer or template the text is used as it is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from jaxkv.eval.realtext import chat_frame
from jaxkv.eval.tasks import Instance


def _read_jsonl(path: str | Path, limit: int | None) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from e
            if limit is not None and len(rows) >= limit:
                break
    return rows


def _split_lines(text: str, num_segments: int) -> list[str]:
    """Split text at line boundaries into <= num_segments chunks of about equal length (lossless)."""
    lines = text.splitlines(keepends=True)
    if num_segments <= 1 or len(lines) <= 1:
        return [text]
    target = len(text) / num_segments
    out, cur = [], ""
    for line in lines:
        cur += line
        if len(cur) >= target and len(out) < num_segments - 1:
            out.append(cur)
            cur = ""
    if cur:
        out.append(cur)
    return out


def _frame(tokenizer) -> tuple[str, str]:
    """(before, after) the user content: the chat template's turn, or nothing."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return "", ""
    return chat_frame(tokenizer)


def load_ruler_jsonl(path: str | Path, num_segments: int = 4, limit: int | None = None,
                     tokenizer=None) -> list[Instance]:
    head, tail = _frame(tokenizer)
    instances = []
    for i, row in enumerate(_read_jsonl(path, limit)):
        if "input" not in row or "outputs" not in row:
            raise ValueError(f"{path}: record {i} lacks 'input' or 'outputs' (RULER JSONL)")
        outputs = [str(o) for o in row["outputs"]]
        instances.append(Instance(
            task=f"ruler:{Path(path).stem}", prefix=head,
            segments=tuple(_split_lines(row["input"], num_segments)),
            suffix=tail + row.get("answer_prefix", "").lstrip() if tail else row.get("answer_prefix", ""),
            target=", ".join(outputs), answers=tuple(outputs),
            metric="all", meta={"index": row.get("index", i), "length": row.get("length")}))
    return instances


_PASSAGE = re.compile(r"(?=Passage \d+:)")


def load_longbench_jsonl(path: str | Path, num_segments: int = 4, limit: int | None = None,
                         tokenizer=None) -> list[Instance]:
    head, tail = _frame(tokenizer)
    instances = []
    for i, row in enumerate(_read_jsonl(path, limit)):
        if "context" not in row or "answers" not in row or "input" not in row:
            raise ValueError(f"{path}: record {i} lacks 'input', 'context' or 'answers' (LongBench JSONL)")
        ctx = row["context"]
        parts = [p for p in _PASSAGE.split(ctx) if p]
        segments = parts if len(parts) > 1 else _split_lines(ctx, num_segments)
        answers = tuple(str(a) for a in row["answers"])
        instances.append(Instance(
            task=f"longbench:{row.get('dataset', Path(path).stem)}",
            prefix=head + "Answer the question based on the given passages. Only give me the answer.\n\n",
            segments=tuple(segments),
            suffix=f"\n\nQuestion: {row['input']}" + (tail + "Answer:" if tail else "\nAnswer:"),
            target=answers[0] if answers else "",
            answers=answers, metric="f1", meta={"id": row.get("_id", i), "length": row.get("length")}))
    return instances
