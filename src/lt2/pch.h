// Precompiled header: the heavy libtorch and JSON headers, compiled once per build.
#pragma once
#include <torch/torch.h>
#include <nlohmann/json.hpp>
