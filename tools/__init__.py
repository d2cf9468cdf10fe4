"""Measurement tools, outside the core: the serialized baseline (`baseline`), the bench's
transfer methods (`bench_methods`), synthetic weights (`synth`), the cluster simulator
(`simulate`)."""
