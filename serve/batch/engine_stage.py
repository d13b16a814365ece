"""ray.data.llm's vLLM engine stage with rayline's engine start-up (serve.engine.apply_engine_core_start).

Kept apart from pipeline.py because importing it pulls in vLLM (through Ray's stage module).
"""

from __future__ import annotations

from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF

from serve import engine as eng


class EngineStageUDF(vLLMEngineStageUDF):
    """Ray's engine stage UDF, started the way the engine config says (fork on CPU: no second vLLM import)."""

    def __init__(self, *args, **kwargs):
        eng.apply_engine_core_start()
        super().__init__(*args, **kwargs)


def use_rayline_engine_stage(processor) -> None:
    """Run `processor`'s vLLM engine stage with EngineStageUDF; the stage keeps every other setting.

    A copy, not an assignment: the stage validates assignments by re-running its set-up on the already
    processed arguments, which loses the placement group and asks for a GPU."""
    name = "vLLMEngineStage"
    processor.stages[name] = processor.get_stage_by_name(name).model_copy(update={"fn": EngineStageUDF})
