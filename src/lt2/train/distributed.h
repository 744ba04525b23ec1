// Data-parallel training over c10d, PyTorch's distributed engine: a TCP store for the rendezvous,
// Gloo for CPU tensors, NCCL for CUDA tensors.
//
// A job is W processes (ranks), each with a full copy of the model. Every optimizer step, rank r
// runs the micro-batches r, r + W, r + 2W, ... of the step's global batch (grad_accum
// micro-batches of batch_size sequences, the same whatever W), and the gradients are summed over
// the ranks in buckets while backward still runs. Every rank then takes the same optimizer step.
//
// Rendezvous from the environment torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT. Rank 0 hosts the store, unless TORCHELASTIC_USE_AGENT_STORE=True says the launcher
// hosts it (torchrun's agent; `lt2 train --nproc N`, which hosts it on a free port).
//
// Three parts, one header each:
//   train/rendezvous.h        DistEnv (the environment), local_micro_batches, ProcessGroup (the
//                             store, the join, Gloo/NCCL, collectives with timeouts)
//   train/gradient_reducer.h  GradientBuckets: the bucketed all-reduce during backward
//   train/launcher.h          run_local_ranks: `lt2 train --nproc N`
#pragma once
#include "lt2/train/gradient_reducer.h"
#include "lt2/train/launcher.h"
#include "lt2/train/rendezvous.h"
