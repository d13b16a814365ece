"""Input rows -> engine requests, engine outputs -> result rows; bad rows get a reason instead of an engine call.

Every input row leaves `PromptValidator` exactly once, either as a request (rendered prompt, token ids,
full sampling parameters) or with `__inference_error__` set to `<code>: <reason>`. The validator runs in the
engine actor, on each batch just before Ray's engine stage sees it (serve/batch/engine_stage.py); that stage
passes rows with the column set straight through without calling the engine (the same column its
`should_continue_on_error` uses for engine failures), so one streaming pass keeps every row: no join or
union afterwards. `result_rows` then gives both kinds the one result schema (RESULT_SCHEMA).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

import pyarrow as pa

from core import metrics as rayline_metrics

SOURCE_COLUMN = "source"  # where an input row came from (serve/batch/inputs.py)
MODEL_COLUMN = "model_version"  # which model answers the row, in a job with adapters (serve/batch/inputs.py)
ERROR_COLUMN = "__inference_error__"  # ray.data.llm's per-row error column (processor/base.py, stages/base.py)
ROLES = ("system", "user", "assistant")

# Error codes: the first word of a result row's `error`.
INVALID_RECORD = "invalid_record"
MISSING_PROMPT = "missing_prompt"
PROMPT_TOO_LONG = "prompt_too_long"
INVALID_SAMPLING = "invalid_sampling_params"
ENGINE_ERROR = "engine_error"
REFUSAL_CODES = (INVALID_RECORD, MISSING_PROMPT, PROMPT_TOO_LONG, INVALID_SAMPLING)

RESULT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("task", pa.string()),
    ("prompt", pa.string()),
    ("reference", pa.string()),
    ("output", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("output_tokens", pa.int64()),
    ("finish_reason", pa.string()),
    ("model_version", pa.string()),
    ("error", pa.string()),
    ("engine_start_s", pa.float64()),
    ("engine_end_s", pa.float64()),
])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# (parameter, check, what a valid value is); the ranges are vLLM's SamplingParams rules.
SAMPLING_RULES = (
    ("max_tokens", lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    ("min_tokens", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    ("temperature", lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    ("top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
    ("top_k", lambda v: _is_int(v) and (v >= 1 or v in (0, -1)), "an integer >= 1, or 0 / -1 for off"),
    ("min_p", lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    ("repetition_penalty", lambda v: _is_num(v) and v > 0, "a number > 0"),
    ("presence_penalty", lambda v: _is_num(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    ("frequency_penalty", lambda v: _is_num(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    ("ignore_eos", lambda v: isinstance(v, bool), "true or false"),
    ("seed", lambda v: v is None or _is_int(v), "an integer or null"),
)
SAMPLING_PARAMS = tuple(name for name, _, _ in SAMPLING_RULES)


def sampling_problem(params: dict[str, Any], where: str = "sampling_params") -> str | None:
    """What is wrong with a sampling-parameter mapping (naming the parameter), or None when vLLM will accept it."""
    unknown = sorted(set(params) - set(SAMPLING_PARAMS))
    if unknown:
        return f"{where}.{unknown[0]}: unknown parameter (known: {', '.join(SAMPLING_PARAMS)})"
    for name, ok, wanted in SAMPLING_RULES:
        if name in params and not ok(params[name]):
            return f"{where}.{name}: must be {wanted}, got {params[name]!r}"
    if params.get("min_tokens", 0) > params.get("max_tokens", 16):
        return f"{where}.min_tokens: {params['min_tokens']} is more than max_tokens {params['max_tokens']}"
    return None


def row_id(record: Any, raw: str) -> str:
    """The record's `id`, else a content hash (stable across runs, so results can be joined back)."""
    if isinstance(record, dict) and record.get("id") not in (None, ""):
        return str(record["id"])
    return "sha1:" + hashlib.sha1(raw.encode("utf-8", "replace")).hexdigest()[:16]


def split_messages(messages: Any) -> tuple[list[dict] | None, str | None, str | None]:
    """Chat messages -> (prompt messages, reference answer, problem). A trailing assistant message is the reference."""
    if not isinstance(messages, list) or not messages:
        return None, None, f"{MISSING_PROMPT}: messages must be a non-empty list, got {type(messages).__name__}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            return None, None, f"{INVALID_RECORD}: messages[{i}].role: {role!r} is not one of {list(ROLES)}"
        if not isinstance(m.get("content"), str):
            return None, None, f"{INVALID_RECORD}: messages[{i}].content: expected a string"
    clean = [{"role": m["role"], "content": m["content"]} for m in messages]
    reference = None
    if clean[-1]["role"] == "assistant":
        reference = clean.pop()["content"]
    if not clean or clean[-1]["role"] != "user" or not clean[-1]["content"].strip():
        return None, reference, f"{MISSING_PROMPT}: no user message to answer (the last prompt message must be the user's)"
    return clean, reference, None


def plain(value: Any) -> Any:
    """A row value as plain Python: Ray Data hands a stage nested values as numpy arrays and scalars."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class PromptValidator:
    """Raw input rows -> engine requests or error rows, with the model's tokenizer (loaded once).

    A row is refused, with a reason, when it is not a JSON object, has no prompt, its prompt does not fit the
    context (`max_model_len` tokens, leaving at least one for output), or its sampling parameters are invalid.
    """

    def __init__(self, model_path: str, max_model_len: int, sampling_defaults: dict[str, Any], jsonl: bool,
                 models: dict[str, str] | None = None):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.max_model_len = max_model_len
        self.defaults = dict(sampling_defaults)
        self.jsonl = jsonl
        self.models = models
        """In a job with adapters: model label -> what Ray's engine stage reads from a request's `model` (the base's
        path for the base, an adapter's local directory for a LoRA request)."""

    def requests(self, rows: Any) -> list[dict[str, Any]]:
        """A batch's raw rows (a list, or Ray Data's numpy array of dicts), each as its request or error row."""
        return [self.request(plain(r)) for r in rows]

    def request(self, row: dict[str, Any]) -> dict[str, Any]:
        source = row.pop(SOURCE_COLUMN, None)
        label = row.pop(MODEL_COLUMN, None) if self.models else None
        raw = (row.get("text") or "") if self.jsonl else json.dumps(row, sort_keys=True, default=str)
        out = {
            "id": row_id(row, raw), SOURCE_COLUMN: source, "task": None, "reference": None, "prompt": "",
            "tokenized_prompt": [], "prompt_tokens": 0, "sampling_params": dict(self.defaults), ERROR_COLUMN: "",
        }
        if self.models:
            out.update({MODEL_COLUMN: label, "model": self.models[label]})
        record: Any = row
        if self.jsonl:
            if row.get("text") is None:
                return {**out, ERROR_COLUMN: f"{INVALID_RECORD}: the line is not UTF-8 text"}
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as e:
                return {**out, ERROR_COLUMN: f"{INVALID_RECORD}: not valid JSON ({e.msg} at column {e.colno})"}
            out["id"] = row_id(record, raw)
        if not isinstance(record, dict):
            return {**out, ERROR_COLUMN: f"{INVALID_RECORD}: expected a JSON object, got {type(record).__name__}"}
        out["task"] = str(record["task"]) if record.get("task") is not None else None
        if record.get("reference") is not None:
            out["reference"] = str(record["reference"])

        overrides = record.get("sampling_params") or {}
        if not isinstance(overrides, dict):
            return {**out, ERROR_COLUMN: f"{INVALID_SAMPLING}: sampling_params must be a mapping"}
        # Parquet structs carry every key of the column, null where a row did not set it.
        params = {**self.defaults, **{k: v for k, v in overrides.items() if v is not None}}
        problem = sampling_problem(params)
        if problem:
            return {**out, ERROR_COLUMN: f"{INVALID_SAMPLING}: {problem}"}

        if record.get("messages") is not None:
            messages, reference, problem = split_messages(record["messages"])
            out["reference"] = out["reference"] or reference
            if problem:
                return {**out, ERROR_COLUMN: problem}
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # The template already writes the special tokens; adding them again would shift every prompt.
            token_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(record.get("prompt"), str) and record["prompt"].strip():
            prompt = record["prompt"]
            token_ids = self.tokenizer(prompt)["input_ids"]
        else:
            return {**out, ERROR_COLUMN: f"{MISSING_PROMPT}: the row has neither `messages` nor a non-empty `prompt`"}

        out.update(prompt=prompt, prompt_tokens=len(token_ids))
        if len(token_ids) >= self.max_model_len:
            return {**out, ERROR_COLUMN: (
                f"{PROMPT_TOO_LONG}: {len(token_ids)} prompt tokens, but max_model_len is {self.max_model_len} "
                "(prompt + output must fit)"
            )}
        return {**out, "tokenized_prompt": token_ids, "sampling_params": params}


def finish_reason(output_tokens: int, prompt_tokens: int, max_tokens: int, max_model_len: int) -> str:
    """vLLM stops for a stop condition (EOS, stop token/string) or for length; ray.data.llm drops the reason,
    but the counts tell them apart: a `length` finish used every token it was allowed."""
    if output_tokens >= max_tokens or prompt_tokens + output_tokens >= max_model_len:
        return "length"
    return "stop"


def result_rows(batch: pa.Table, model_version: str, max_model_len: int, metric_tags: dict | None = None) -> pa.Table:
    """Processor output (engine rows and pass-through error rows alike) -> RESULT_SCHEMA rows, each with the
    model that answered it (its own `model_version`, in a job with adapters, else `model_version`); with
    `metric_tags`, also counts them in rayline's batch metrics (rows done, errors by code, output tokens)."""
    out: dict[str, list] = {name: [] for name in RESULT_SCHEMA.names}
    for row in batch.to_pylist():
        error = row.get(ERROR_COLUMN) or None
        if error and error.split(":", 1)[0] not in REFUSAL_CODES:
            error = f"{ENGINE_ERROR}: {error}"  # raised inside the engine, not refused by PromptValidator
        metrics = row.get("metrics") or {}
        ok = error is None
        n_out = int(row.get("num_generated_tokens") or 0) if ok else 0
        params = row.get("sampling_params") or {}
        out["id"].append(row["id"])
        out["source"].append(row.get(SOURCE_COLUMN))
        out["task"].append(row.get("task"))
        out["prompt"].append(row.get("prompt") or "")
        out["reference"].append(row.get("reference"))
        out["output"].append(row.get("generated_text", "") if ok else None)
        out["prompt_tokens"].append(int(row.get("prompt_tokens") or 0))
        out["output_tokens"].append(n_out)
        out["finish_reason"].append(
            finish_reason(n_out, int(row.get("prompt_tokens") or 0), int(params.get("max_tokens") or 0), max_model_len)
            if ok else None
        )
        out["model_version"].append(row.get(MODEL_COLUMN) or model_version)
        out["error"].append(error)
        # Engine-core clock (monotonic, one per node): first queued -> last token spans the engine's busy time.
        out["engine_start_s"].append(metrics.get("queued_ts") if ok and metrics.get("queued_ts") else None)
        out["engine_end_s"].append(metrics.get("last_token_ts") if ok and metrics.get("last_token_ts") else None)
    if metric_tags is not None:
        count_rows(out, metric_tags)
    return pa.Table.from_pydict(out, schema=RESULT_SCHEMA)


def count_rows(out: dict[str, list], tags: dict) -> None:
    rayline_metrics.inc("rayline_batch_rows_done", len(out["id"]), **tags)
    rayline_metrics.inc("rayline_batch_output_tokens", sum(out["output_tokens"]), **tags)
    for code, n in Counter(e.split(":", 1)[0] for e in out["error"] if e).items():
        rayline_metrics.inc("rayline_batch_row_errors", n, code=code, **tags)
