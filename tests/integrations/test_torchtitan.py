"""torchtitan's llama3 at a tiny size, parallelized by torchtitan's own `parallelize_llama`
(tensor parallelism, with sequence parallelism, under FSDP2 on a (2, 2) mesh), trains with seqfast
on CPU gloo ranks and matches `backend="eager"`: the loss and every gathered gradient, with the
families' fused counts asserted.

torchtitan on CPU needs the spellings `docs/integrations.md#torchtitan` gives (its mesh on "cpu",
SDPA built as a config, float32 parameters, `partial_dtensor`, sum reductions for gloo); each is
marked where it is made. Skipped where torchtitan is not installed: it is no test dependency
(its `datasets` pin conflicts with ours), and `.ci/run` installs it without its dependencies."""

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from seqcompile.codegen.launches import counting_launches
from seqcompile.report import collecting

from .test_tensor_parallel import assert_launched, process_group

pytest.importorskip("torchtitan", reason="torchtitan is not installed")
pytestmark = pytest.mark.slow

DIM, VOCAB, HEADS, LAYERS, BATCH, LENGTH = 32, 64, 4, 2, 2, 8


def tiny_llama(sequence_parallel):
    """torchtitan's llama3 config at a tiny size, its attention the SDPA module (torchtitan
    refuses `attn_backend="sdpa"` by name, and flex attention has no backward on CPU)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=10000.0, scaling="none")
    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)
        ),
        layers=_build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, hidden_dim=2 * DIM, rope=rope,
            attn_backend="flex",
        ),
    )  # fmt: skip
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    return config


def parallelized(parallel_dims, sequence_parallel):
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3.parallelize import parallelize_llama

    torch.manual_seed(0)
    model = tiny_llama(sequence_parallel).build()
    model.init_states()
    parallelism = ParallelismConfig(
        tensor_parallel_degree=parallel_dims.tp,
        data_parallel_shard_degree=parallel_dims.dp_shard,
        enable_sequence_parallel=sequence_parallel,
        spmd_backend="partial_dtensor",
    )
    parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),  # eager's numbers, not bf16's
        parallelism=parallelism,
        compile_config=CompileConfig(enable=False),
        ac_config=None,
        dump_folder=tempfile.mkdtemp(),
    )
    for module in model.modules():  # gloo reduces no PREMUL_SUM
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def step(world, data_parallel, sequence_parallel, compile_backend):
    import torchtitan.distributed.parallel_dims as dims
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  the "fake" backend
    from torchtitan.distributed import ParallelDims

    dims.device_type = "cpu"  # torchtitan names "cuda" where no accelerator is found
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=data_parallel, cp=1, tp=world // data_parallel, pp=1, ep=1,
        world_size=world, spmd_backend="partial_dtensor",
    )  # fmt: skip
    parallel_dims.build_mesh()
    model = parallelized(parallel_dims, sequence_parallel)
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(VOCAB, (BATCH, LENGTH), generator=g) for _ in "it")
    positions = torch.arange(LENGTH).expand(BATCH, LENGTH)
    logits = torch.compile(model, backend=compile_backend)(tokens, positions)
    logits = getattr(logits, "full_tensor", lambda: logits)()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in model.parameters()]
    return loss.detach(), grads


def _worker(rank, store, world, data_parallel, sequence_parallel, fused, kernels):
    torch.set_num_threads(1)
    if kernels:
        os.environ["SEQFAST_INTERPRET"] = "1"
    with process_group(rank, world, store):
        expected, expected_grads = step(world, data_parallel, sequence_parallel, "eager")
        torch._dynamo.reset()
        with collecting() as report, counting_launches() as launched:
            got, grads = step(world, data_parallel, sequence_parallel, "seqfast")
        if kernels:
            assert_launched(launched, fused)
        torch.testing.assert_close(got, expected)
        for g, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
        assert dict(report.counts) == fused, str(report)


FUSED = {"attention": 1, "norm": 3, "pointwise": 3}  # one block's graph, reused, and the tail
SETUPS = {
    "tensor-parallel": (2, 1, False, FUSED, False),
    "sequence-parallel": (2, 1, True, FUSED, False),
    "sequence-parallel-kernels": (2, 1, True, FUSED, True),
    "fsdp2-tp": (4, 2, True, FUSED, False),
}


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_torchtitan_llama3_parallelized_by_torchtitan_matches_eager(name):
    world, data_parallel, sequence_parallel, fused, kernels = SETUPS[name]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(
            _worker,
            args=(f"{folder}/store", world, data_parallel, sequence_parallel, fused, kernels),
            nprocs=world,
            join=True,
        )
