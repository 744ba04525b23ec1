// The launcher of a local data-parallel job (lt2/train/distributed.h): `lt2 train --nproc N`
// starts the ranks through util/process, hosts their store and watches them.
#pragma once
#include <string>
#include <vector>

namespace lt2 {

// `lt2 train --nproc N`: runs `exe args...` N times on this machine as ranks 0..N-1 of one job.
// This process hosts the store on a free port and sets RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE=True for each rank
// (and OMP_NUM_THREADS = cores / N when unset). The ranks share this terminal (only rank 0 logs).
// When a rank fails, the others are stopped and lt2::Error says which rank failed and how;
// SIGINT/SIGTERM are passed on to the ranks. Returns when every rank has exited successfully.
void run_local_ranks(int nproc, const std::string& exe, const std::vector<std::string>& args);

}  // namespace lt2
