"""The RL loop of vllm_fsdp2.py with a Megatron-core trainer: a GPT model (Llama-shaped: RMSNorm,
SwiGLU, rotary, grouped queries) in tensor parallel over 2 ranks pushes its weights through
reshard straight into vLLM (TP 2) after every step.

    python examples/vllm_megatron.py [--json out.json --save-weights DIR] [--server]

The one trainer-side line: `TrainerWorker.from_module(WORKERS, gpt_model)` reads the layout from
the model's sharded state dict (interleaved QKV per query group, the SwiGLU halves) and maps it to
the Hugging Face names vLLM's side uses. A step here is a fixed perturbation of the weights (a
stand-in for Megatron's optimizer step, which needs Megatron's training loop)."""

from __future__ import annotations

import os

from vllm_fsdp2 import CONFIGS, main


def megatron_trainer(rank: int, world: int, port: int, workers: str, model_dir: str, vocab: int, steps: int, save: str,
                     go, done, api=None) -> None:
    if api:
        raise SystemExit("examples/vllm_megatron.py: --trainer-api is shown with the FSDP2 trainer (vllm_fsdp2.py)")
    import json

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from reshard.integrations.megatron import full_state
    from reshard.trainer_svc.worker import TrainerWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    cfg = TransformerConfig(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                            num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
                            kv_channels=hf["head_dim"], ffn_hidden_size=hf["intermediate_size"], gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"],
                            add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32)
    torch.manual_seed(0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=vocab, max_sequence_length=256,
                     position_embedding_type="rope", rotary_base=int(hf["rope_theta"]), share_embeddings_and_output_weights=False)
    worker = TrainerWorker.from_module(workers, model, run="rl").start()
    for step in range(1, steps + 1):
        go.get()
        with torch.no_grad():  # the stand-in for an optimizer step: the same noise on replicated weights
            for i, (name, p) in enumerate(model.named_parameters()):
                sharded = getattr(p, "tensor_model_parallel", False)
                g = torch.Generator().manual_seed(step * 100003 + i * 7 + (rank if sharded else 0))
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        handle = worker.publish(step)
        if rank == 0:  # the driver asks vLLM for the step now: a bounded vLLM takes it inside update_weights
            done.put((step, 0.0))
        if not handle.wait(300):
            raise RuntimeError(f"trainer rank {rank}: step {step} was not taken within 300 s")
        full = full_state(model)  # Hugging Face names, for the checks (a collective)
        if save and rank == 0:
            torch.save(full, os.path.join(save, f"step{step}.pt"))
    worker.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    assert "llama-gqa" in CONFIGS
    main(megatron_trainer, default_model="llama-gqa", doc=__doc__)
