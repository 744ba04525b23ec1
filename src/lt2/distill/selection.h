// KL-guided layer selection (spec/models.md §4): rank the converted layers by how much restoring
// each one alone to full attention (in every loop) lowers the KL to the teacher after a short
// stage-2 probe, and keep the top K full attention (K = round(keep_fraction x N) minus the layers
// the config keeps anyway).
//
// The published ranking (method "exhaustive") trains one probe of `probe_steps` per candidate layer,
// N + 1 probes. The cheaper one (method "shared", the default) scores every layer on one model: the
// aligned student after `shared_probe_steps` of stage 2 (default 0: the aligned student itself), each
// layer restored in turn (the teacher's attention weights, everything else that model's) and the KL
// measured with no further training: at most 1 probe + N + 1 evaluations. Both measure the KL on the
// same held-out batches; method "both" runs the two and reports how their choices agree (top-K
// overlap, Spearman rank correlation of the gains). Why 0 steps by default: a probe co-adapts the
// linear layers to one another, so restoring one of them then disturbs the rest; on the aligned
// student each layer is still a stand-in for its own attention (bench/results/distill_selection_cpu.md).
//
// Files (in <out>/select): selection.json and selection.md (the report), probes.json (each finished
// probe's KL, so a resumed selection skips them; probe run folders are removed once measured).
#pragma once
#include <string>
#include <vector>

#include "lt2/distill/config.h"

namespace lt2::distill {

struct LayerScore {
  int64_t layer = 0;
  double kl = 0;    // held-out KL with this layer restored to full attention
  double gain = 0;  // baseline KL - kl: how much restoring it helps
};

struct Ranking {
  std::string method;       // "shared" | "exhaustive"
  double baseline_kl = 0;   // KL of the probe with no layer restored
  int64_t probe_steps = 0;  // stage-2 steps of each probe
  int64_t probes = 0;       // stage-2 probes trained
  int64_t evaluations = 0;  // held-out KL measurements
  std::vector<LayerScore> scores;  // by layer
  std::vector<int64_t> chosen;     // the top K by gain, ascending
};

struct Selection {
  std::vector<Ranking> rankings;  // shared and/or exhaustive
  std::vector<int64_t> keep;      // layers kept full attention: the config's and the chosen
  int64_t k = 0;                  // layers chosen
  json to_json() const;
  std::string markdown() const;
};

// The top `k` layers by gain (ties: the lower layer), ascending.
std::vector<int64_t> top_layers(const std::vector<LayerScore>& scores, int64_t k);
// Spearman rank correlation of the gains of two rankings over the same layers.
double spearman(const std::vector<LayerScore>& a, const std::vector<LayerScore>& b);

// Runs the selection from the aligned student `aligned` (a checkpoint folder) and writes the
// report. `resume`: reuse the probes.json of an earlier, interrupted selection.
Selection select_layers(LoopedLMImpl& teacher, const std::string& aligned, const DistillConfig& cfg,
                        const std::string& out, bool resume);

// The selection report of <out>/select/selection.json, read back.
std::vector<int64_t> selected_keep(const std::string& out);

}  // namespace lt2::distill
