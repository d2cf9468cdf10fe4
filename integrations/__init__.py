"""Engine integrations: layouts read from live models, and backends that plug reshard into the
engines people run.

- `reshard.integrations.names`: canonical (Hugging Face) names, shared by both sides.
- `reshard.integrations.dtensor`: a trainer layout from a module whose parameters are DTensors
  (FSDP2, tensor parallel through `parallelize_module`, 2-D meshes); `TrainerWorker.from_module`.
- `reshard.integrations.vllm`: the `reshard` weight-transfer backend for vLLM.
"""
