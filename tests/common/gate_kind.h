// The log-gate kinds the recurrence tests run over: none, one decay per head, one per key channel.
#pragma once

namespace lt2::testing {

enum class Gate { None, Head, Channel };

inline const char* gate_name(Gate g) {
  return g == Gate::None ? "no gate" : g == Gate::Head ? "per-head" : "per-channel";
}

}  // namespace lt2::testing
