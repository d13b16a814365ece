"""ray.data.llm's vLLM engine stage with rayline's engine start-up (serve.online.engine.apply_engine_core_start),
the prompt validation in front of it, and requests that ask vLLM for their final output only.

Kept apart from pipeline.py because importing it pulls in vLLM (through Ray's stage module).
"""

from __future__ import annotations

import json
from typing import Any

from core.collector import heavy_imports, preload

with heavy_imports():  # an engine worker's start is mostly these imports (core/collector.py)
    from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF

from serve.online import engine as eng
from serve.batch.engine_setup import SETUP_LINE, effective_setup
from serve.batch.rows import ERROR_COLUMN, PromptValidator


class EngineStageUDF(vLLMEngineStageUDF):
    """Ray's engine stage UDF, started the way the engine config says (fork on CPU: no second vLLM import),
    that turns each batch's raw input rows into requests or refusals (rows.PromptValidator) before Ray's
    stage sees them, and whose requests ask vLLM for their final output only (final_outputs_only). Once its
    engine is up it prints the engine's effective set-up (engine_setup.effective_setup) on one line.

    Validating here rather than in an actor of its own: the engine process has transformers imported and the
    tokenizer on disk already, while a validator actor costs a worker process and ~4 s of transformers and
    torch imports, on the same cores and at the same moment as the engine's start (the run's critical path).
    Tokenizing a batch takes milliseconds; vLLM takes the token ids as they are.

    `validator`: PromptValidator's arguments other than the model (max_model_len, sampling_defaults, jsonl).
    """

    def __init__(self, *args, validator: dict[str, Any], **kwargs):
        preload("vllm.v1.engine.async_llm")  # the engine's imports, in the worker only (the driver has no vLLM)
        eng.apply_engine_core_start()
        super().__init__(*args, **kwargs)
        self.validator = PromptValidator(self.model, **validator)
        print(SETUP_LINE + json.dumps(effective_setup(self.llm.engine)), flush=True)

    async def __call__(self, batch: dict[str, Any]):
        if isinstance(batch, dict) and self.data_column in batch:
            batch[self.data_column] = final_outputs_only(self.validator.requests(batch[self.data_column]))
        async for out in super().__call__(batch):
            yield out


def final_outputs_only(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ask vLLM for each request's final output only (output kind FINAL_ONLY, as vLLM's own `LLM.generate`
    does), through the request's `sampling_params`, which Ray's stage passes to `vllm.SamplingParams` as they
    are. Left at vLLM's default (CUMULATIVE), every engine step builds, for every running request, an output
    with all its text and tokens so far, which the stage reads and drops until the last one: per-token Python
    work on the cores the engine computes on. Refused rows are left as they are (they never reach vLLM)."""
    from vllm.sampling_params import RequestOutputKind

    for request in requests:
        if not request[ERROR_COLUMN]:
            request["sampling_params"]["output_kind"] = RequestOutputKind.FINAL_ONLY
    return requests


def use_rayline_engine_stage(processor, validator: dict[str, Any], node_labels: dict[str, str] | None = None) -> None:
    """Run `processor`'s vLLM engine stage with EngineStageUDF (validating with `validator`'s settings), its actors
    only on nodes matching `node_labels` (Ray Data's `label_selector`) when given; the stage keeps every other
    setting.

    A copy, not an assignment: the stage validates assignments by re-running its set-up on the already
    processed arguments, which loses the placement group and asks for a GPU."""
    name = "vLLMEngineStage"
    stage = processor.get_stage_by_name(name)
    kwargs = {**stage.fn_constructor_kwargs, "validator": validator}
    update = {"fn": EngineStageUDF, "fn_constructor_kwargs": kwargs}
    if node_labels:
        update["map_batches_kwargs"] = {**stage.map_batches_kwargs, "label_selector": dict(node_labels)}
    processor.stages[name] = stage.model_copy(update=update)
