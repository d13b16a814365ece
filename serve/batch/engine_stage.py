"""ray.data.llm's vLLM engine stage with rayline's engine start-up (serve.engine.apply_engine_core_start) and
answers sent once per request.

Kept apart from pipeline.py because importing it pulls in vLLM (through Ray's stage module).
"""

from __future__ import annotations

from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF

from serve import engine as eng


class EngineStageUDF(vLLMEngineStageUDF):
    """Ray's engine stage UDF, started the way the engine config says (fork on CPU: no second vLLM import),
    whose requests ask vLLM for their final output only."""

    def __init__(self, *args, **kwargs):
        eng.apply_engine_core_start()
        super().__init__(*args, **kwargs)
        final_outputs_only(self.llm)


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


def use_rayline_engine_stage(processor) -> None:
    """Run `processor`'s vLLM engine stage with EngineStageUDF; the stage keeps every other setting.

    A copy, not an assignment: the stage validates assignments by re-running its set-up on the already
    processed arguments, which loses the placement group and asks for a GPU."""
    name = "vLLMEngineStage"
    processor.stages[name] = processor.get_stage_by_name(name).model_copy(update={"fn": EngineStageUDF})
