"""Tensor, sequence and data parallelism (Megatron-core ``tensor_parallel`` parity), FP8-aware.

Everything here that talks to ``torch.distributed`` takes its process group as an argument; ``None`` means a
single rank. See each module: ``mappings`` (region mappings), ``layers`` (Column/RowParallelLinear),
``linear_ops`` (``TPLinearComm``: the communication the linear/MLP ops run, per-tensor and block-scaled),
``embedding``, ``cross_entropy``, ``lm_head_loss`` (the fused vocab-parallel LM head + loss), ``random`` (RNG
tracker, Megatron's ``checkpoint``, TransformerEngine's ``te_checkpoint``), ``utils`` (``VocabUtility``, 1-D
split/gather), ``data`` (broadcast_data), ``mesh`` (ParallelDims, init_parallel), ``fp8_comm`` (FP8 all-gather),
``inference``, ``data_parallel`` (GradientAverager: data-parallel gradient averaging a CUDA graph captures),
``fsdp`` (shard_model: FSDP2) and ``fsdp_fp8`` (FSDP2's FP8 weight all-gather).
"""
from fp8engine.parallel.cross_entropy import vocab_parallel_cross_entropy
from fp8engine.parallel.data import broadcast_data
from fp8engine.parallel.data_parallel import GradientAverager, broadcast_parameters
from fp8engine.parallel.embedding import VocabParallelEmbedding
from fp8engine.parallel.fp8_comm import cast_and_all_gather_fp8, measure_sp_all_gather, sp_all_gather_bytes
from fp8engine.parallel.fsdp import shard_model
from fp8engine.parallel.inference import (InferenceLayerNormColumnParallelLinear, InferenceRowParallelLinear,
                                          reduce_scatter_residual_rmsnorm_all_gather)
from fp8engine.parallel.layers import ColumnParallelLinear, RowParallelLinear, all_reduce_sequence_parallel_grads
from fp8engine.parallel.lm_head_loss import vocab_parallel_linear_cross_entropy
from fp8engine.parallel.mappings import (all_gather_last_dim_from_tensor_parallel_region, all_to_all,
                                         all_to_all_hp2sp, all_to_all_sp2hp, copy_to_tensor_model_parallel_region,
                                         gather_from_sequence_parallel_region,
                                         gather_from_tensor_model_parallel_region,
                                         reduce_from_tensor_model_parallel_region,
                                         reduce_scatter_last_dim_to_tensor_parallel_region,
                                         reduce_scatter_to_sequence_parallel_region,
                                         scatter_to_sequence_parallel_region,
                                         scatter_to_tensor_model_parallel_region)
from fp8engine.parallel.mesh import ParallelDims, ParallelEnv, init_parallel
from fp8engine.parallel.random import (CheckpointWithoutOutput, RNGStatesTracker, checkpoint, default_rng_tracker,
                                       model_parallel_manual_seed, te_checkpoint)
from fp8engine.parallel.utils import (VocabUtility, gather_split_1d_tensor, get_group_rank, get_group_size,
                                      split_tensor_along_last_dim, split_tensor_into_1d_equal_chunks)

__all__ = ["GradientAverager", "broadcast_parameters", "shard_model", "copy_to_tensor_model_parallel_region",
           "reduce_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
           "gather_from_tensor_model_parallel_region", "scatter_to_sequence_parallel_region",
           "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
           "all_gather_last_dim_from_tensor_parallel_region", "reduce_scatter_last_dim_to_tensor_parallel_region",
           "all_to_all", "all_to_all_sp2hp", "all_to_all_hp2sp", "ColumnParallelLinear", "RowParallelLinear",
           "all_reduce_sequence_parallel_grads", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "vocab_parallel_linear_cross_entropy", "RNGStatesTracker", "default_rng_tracker",
           "model_parallel_manual_seed", "checkpoint", "te_checkpoint", "CheckpointWithoutOutput", "broadcast_data",
           "split_tensor_along_last_dim", "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor",
           "get_group_size", "get_group_rank", "VocabUtility", "ParallelDims", "ParallelEnv", "init_parallel",
           "cast_and_all_gather_fp8", "measure_sp_all_gather", "sp_all_gather_bytes",
           "InferenceLayerNormColumnParallelLinear", "InferenceRowParallelLinear",
           "reduce_scatter_residual_rmsnorm_all_gather"]
