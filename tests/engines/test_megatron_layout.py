"""Trainer layouts read from a real Megatron-core GPT model (megatron-core on CPU, gloo, TP 2):
every piece of every rank's buffers must hold exactly the canonical (Hugging Face) tensor's box,
checked against an independent conversion: the full Megatron parameters (all-gathered from the
ranks) turned into Hugging Face tensors the way conversion scripts do it (QKV viewed as
[groups, heads per group + 2, head dim, hidden] and split; fc1 as gate rows then up rows)."""

import socket

import pytest
import torch

megatron = pytest.importorskip("megatron.core", reason="megatron-core is not installed (the dev extra installs it)")

HEADS, GROUPS, D, HIDDEN, FFN, VOCAB, LAYERS = 4, 2, 32, 128, 256, 1000, 2


def _rank(rank: int, world: int, port: int, vocab_pad: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from reshard.common.layout.core import Layout
    from reshard.integrations.megatron import module_layout

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                            ffn_hidden_size=FFN, kv_channels=D, use_cpu_initialization=True, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
                            params_dtype=torch.float32)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB + vocab_pad,
                     max_sequence_length=128, position_embedding_type="rope", share_embeddings_and_output_weights=False)
    with torch.no_grad():
        for p in model.parameters():  # distinct values everywhere (norms start at ones)
            p.copy_(torch.randn(p.shape))
    r, w, tensors, buffers = module_layout(model, vocab_size=VOCAB if vocab_pad else None)
    assert (r, w) == (rank, world)
    Layout(tensors, (tuple(d for d, _ in buffers.values()),)).validate_rank(0, "megatron")

    # The independent reference: full Megatron tensors, converted as conversion scripts do.
    def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim)

    hf = {}
    params = dict(model.named_parameters())
    hf["model.embed_tokens.weight"] = gather(params["embedding.word_embeddings.weight"].data, 0)[:VOCAB]
    hf["lm_head.weight"] = gather(params["output_layer.weight"].data, 0)[:VOCAB]
    hf["model.norm.weight"] = params["decoder.final_layernorm.weight"].data
    for i in range(LAYERS):
        pre, out = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = gather(params[pre + "self_attention.linear_qkv.weight"].data, 0).view(GROUPS, HEADS // GROUPS + 2, D, HIDDEN)
        hf[out + "self_attn.q_proj.weight"] = qkv[:, : HEADS // GROUPS].reshape(-1, HIDDEN)
        hf[out + "self_attn.k_proj.weight"] = qkv[:, HEADS // GROUPS].reshape(-1, HIDDEN)
        hf[out + "self_attn.v_proj.weight"] = qkv[:, HEADS // GROUPS + 1].reshape(-1, HIDDEN)
        hf[out + "self_attn.o_proj.weight"] = gather(params[pre + "self_attention.linear_proj.weight"].data, 1)
        fc1 = params[pre + "mlp.linear_fc1.weight"].data
        gate, up = fc1.chunk(2, 0)
        hf[out + "mlp.gate_proj.weight"], hf[out + "mlp.up_proj.weight"] = gather(gate, 0), gather(up, 0)
        hf[out + "mlp.down_proj.weight"] = gather(params[pre + "mlp.linear_fc2.weight"].data, 1)
        hf[out + "input_layernorm.weight"] = params[pre + "input_layernorm.weight"].data
        hf[out + "post_attention_layernorm.weight"] = params[pre + "pre_mlp_layernorm.weight"].data
    assert {n: t.shape for n, t in tensors.items()} == {n: tuple(t.shape) for n, t in hf.items()}
    covered = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in hf.items()}
    for desc, t in buffers.values():
        assert t.data_ptr() == params[desc.name].data_ptr(), "buffers must be the parameters themselves"
        for p in desc.pieces:
            assert torch.equal(p.view(t), hf[p.tensor][p.box.slices()]), f"rank {rank}: {desc.name} -> {p.tensor} {p.box}"
            covered[p.tensor][p.box.slices()] += 1
    for n, c in covered.items():  # TP ranks tile the sharded tensors; replicated ones are whole on each
        total = gather(c, 0).view(world, *c.shape).sum(0)
        assert bool((total == 1).all()) or bool((total == world).all()), f"{n}: the ranks' boxes do not tile it"
    dist.destroy_process_group()


@pytest.mark.slow  # 6-7 s (two spawned ranks import Megatron-Core): the quick suite keeps under 5 minutes on 2 cores
@pytest.mark.parametrize("vocab_pad", [0, 24])
def test_megatron_core_layout_matches_an_independent_conversion(vocab_pad):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(2, port, vocab_pad), nprocs=2, start_method="spawn", join=True)
