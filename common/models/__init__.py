"""Model shapes (`frameworks.ModelSpec`) and the layouts real frameworks give them: Megatron,
vLLM, FSDP (`frameworks`); the demo's presets (`presets`)."""
