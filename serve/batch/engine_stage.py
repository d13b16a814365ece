"""ray.data.llm's vLLM engine stage with rayline's engine start-up (serve.engine.apply_engine_core_start),
the prompt validation in front of it, answers sent once per request, and Ray's telemetry report sent from
here.

Kept apart from pipeline.py because importing it pulls in vLLM (through Ray's stage module).
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF

from serve import engine as eng
from serve.batch.driver_start import send_telemetry
from serve.batch.rows import PromptValidator


class EngineStageUDF(vLLMEngineStageUDF):
    """Ray's engine stage UDF, started the way the engine config says (fork on CPU: no second vLLM import),
    that turns each batch's raw input rows into requests or refusals (rows.PromptValidator) before Ray's
    stage sees them, and whose requests ask vLLM for their final output only.

    Validating here rather than in an actor of its own: the engine process has transformers imported and the
    tokenizer on disk already, while a validator actor costs a worker process and ~4 s of transformers and
    torch imports, on the same cores and at the same moment as the engine's start (the run's critical path).
    Tokenizing a batch takes milliseconds; vLLM takes the token ids as they are.

    `validator`: PromptValidator's arguments other than the model (max_model_len, sampling_defaults, jsonl).
    `telemetry`: the usage-telemetry reports the driver kept while building the plan
    (driver_start.telemetry_reports_kept), sent once the engine is up.
    """

    def __init__(self, *args, validator: dict[str, Any], telemetry: list, **kwargs):
        eng.apply_engine_core_start()
        super().__init__(*args, **kwargs)
        final_outputs_only(self.llm)
        self.validator = PromptValidator(self.model, **validator)
        send_telemetry(telemetry)

    async def __call__(self, batch: dict[str, Any]):
        if isinstance(batch, dict) and self.data_column in batch:
            batch[self.data_column] = self.validator.requests(batch[self.data_column])
        async for out in super().__call__(batch):
            yield out


def final_outputs_only(wrapper) -> None:
    """Make `wrapper` (Ray's vLLMEngineWrapper) send generate requests with output_kind FINAL_ONLY, as vLLM's
    own `LLM.generate` does. Ray leaves vLLM's default, CUMULATIVE: every engine step then builds, for every
    running request, an output with all its text and tokens so far, which the stage reads and drops until
    the last one. That is per-token Python work on the cores the engine computes on."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    prepare = wrapper._prepare_llm_request

    async def prepare_final_only(row):
        request = await prepare(row)
        if isinstance(request.params, SamplingParams):
            request.params.output_kind = RequestOutputKind.FINAL_ONLY
        return request

    wrapper._prepare_llm_request = prepare_final_only


def use_rayline_engine_stage(processor, validator: dict[str, Any], telemetry: list) -> None:
    """Run `processor`'s vLLM engine stage with EngineStageUDF (validating with `validator`'s settings, sending
    the `telemetry` reports); the stage keeps every other setting.

    A copy, not an assignment: the stage validates assignments by re-running its set-up on the already
    processed arguments, which loses the placement group and asks for a GPU."""
    name = "vLLMEngineStage"
    stage = processor.get_stage_by_name(name)
    kwargs = {**stage.fn_constructor_kwargs, "validator": validator, "telemetry": telemetry}
    processor.stages[name] = stage.model_copy(update={"fn": EngineStageUDF, "fn_constructor_kwargs": kwargs})
