"""Measurement tools, outside the core: the serialized baseline (`baseline`), the bench's
transfer methods (`bench_methods`), synthetic weights (`synth`), the cluster simulator
(`simulate`), and the measuring commands: `reshard bench` (`bench`), `reshard chaos`
(`chaos`) and `make gpu-check` (`gpu_check`, run through scripts/gpu_check.py)."""
