#include "lt2/ops/decode_options.h"

#include <cstring>
#include <sstream>

#include "lt2/util/error.h"

namespace lt2 {

namespace {

const DecodeOptions kDefaults{};
thread_local const DecodeOptions* current = &kDefaults;

bool parse_bool(const std::string& name, const std::string& v) {
  if (v == "1" || v == "on" || v == "true") return true;
  if (v == "0" || v == "off" || v == "false") return false;
  throw Error(cat("decode option '", name, "': expected 1/0 (on/off, true/false), found '", v, "'"));
}

int64_t parse_int(const std::string& name, const std::string& v, int64_t lo, int64_t hi) {
  try {
    size_t used = 0;
    const long long n = std::stoll(v, &used);
    if (used == v.size() && n >= lo && n <= hi) return n;
  } catch (const std::exception&) {
  }
  throw Error(cat("decode option '", name, "': expected an integer in [", lo, ", ", hi, "], found '", v, "'"));
}

std::vector<std::string> split_list(const std::string& v) {
  std::vector<std::string> out;
  std::stringstream list(v);
  for (std::string item; std::getline(list, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::string join(const std::vector<std::string>& items) {
  std::string s;
  for (const auto& item : items) s += (s.empty() ? "" : ",") + item;
  return s;
}

}  // namespace

bool DecodeOptions::pdl_for(const char* kernel) const {
  if (!pdl) return false;
  for (const auto& prefix : pdl_off)
    if (std::strncmp(kernel, prefix.c_str(), prefix.size()) == 0) return false;
  return true;
}

const std::vector<std::string>& DecodeOptions::names() {
  static const std::vector<std::string> n = {
      "fused", "fused_gemv", "gemv_chain", "chained_tail_max_rows", "gdn_early_state", "delta_rule_scan",
      "scan_value_block", "short_conv", "row_norm", "norm_products_dtype", "residual_norm", "gated_product",
      "cross_entropy_kernel", "rope", "delta_rule_prepare", "gated_linear_prepare", "channel_gate_prepare",
      "delta_rule_output", "delta_rule_output_backward", "window_flash", "channel_scores", "channel_score_rows",
      "channel_score_pairs", "scan_backward_products", "shared_slice_gradients", "chunk_gate", "log_sigmoid_gate",
      "scale_heads", "delta_rule_gates", "gated_prefix_chunks", "gated_sum", "nsa_selection_kernels",
      "dsa_index_kernels", "dsa_head_probs", "dsa_sparse_prefill", "dsa_fold_q_max_rows", "dsa_fold_o_max_rows",
      "topk_max_blocks", "gemv_chain_slots", "pdl", "pdl_off"};
  return n;
}

void DecodeOptions::set(const std::string& name, const std::string& v) {
  if (name == "fused") fused = parse_bool(name, v);
  else if (name == "fused_gemv") fused_gemv = parse_bool(name, v);
  else if (name == "gemv_chain") gemv_chain = parse_bool(name, v);
  else if (name == "chained_tail_max_rows") chained_tail_max_rows = parse_int(name, v, 0, 1 << 20);
  else if (name == "gdn_early_state") gdn_early_state = parse_bool(name, v);
  else if (name == "delta_rule_scan") delta_rule_scan = parse_bool(name, v);
  else if (name == "scan_value_block") {
    scan_value_block = static_cast<int>(parse_int(name, v, 0, 32));
    LT2_CHECK(scan_value_block % 8 == 0 && scan_value_block != 24, "decode option scan_value_block: expected 0, 8, 16 "
              "or 32, found ", v);
  }
  else if (name == "short_conv") short_conv = parse_bool(name, v);
  else if (name == "row_norm") row_norm = parse_bool(name, v);
  else if (name == "norm_products_dtype") norm_products_dtype = parse_bool(name, v);
  else if (name == "residual_norm") residual_norm = parse_bool(name, v);
  else if (name == "gated_product") gated_product = parse_bool(name, v);
  else if (name == "cross_entropy_kernel") cross_entropy_kernel = parse_bool(name, v);
  else if (name == "rope") rope = parse_bool(name, v);
  else if (name == "delta_rule_prepare") delta_rule_prepare = parse_bool(name, v);
  else if (name == "gated_linear_prepare") gated_linear_prepare = parse_bool(name, v);
  else if (name == "channel_gate_prepare") channel_gate_prepare = parse_bool(name, v);
  else if (name == "delta_rule_output") delta_rule_output = parse_bool(name, v);
  else if (name == "delta_rule_output_backward") delta_rule_output_backward = parse_bool(name, v);
  else if (name == "window_flash") window_flash = parse_bool(name, v);
  else if (name == "channel_scores") channel_scores = parse_bool(name, v);
  else if (name == "channel_score_rows") channel_score_rows = parse_bool(name, v);
  else if (name == "channel_score_pairs") channel_score_pairs = parse_bool(name, v);
  else if (name == "scan_backward_products") scan_backward_products = parse_bool(name, v);
  else if (name == "shared_slice_gradients") shared_slice_gradients = parse_bool(name, v);
  else if (name == "chunk_gate") chunk_gate = parse_bool(name, v);
  else if (name == "log_sigmoid_gate") log_sigmoid_gate = parse_bool(name, v);
  else if (name == "scale_heads") scale_heads = parse_bool(name, v);
  else if (name == "delta_rule_gates") delta_rule_gates = parse_bool(name, v);
  else if (name == "gated_prefix_chunks") gated_prefix_chunks = parse_int(name, v, -1, 1 << 30);
  else if (name == "gated_sum") gated_sum = parse_bool(name, v);
  else if (name == "nsa_selection_kernels") nsa_selection_kernels = parse_bool(name, v);
  else if (name == "dsa_index_kernels") dsa_index_kernels = parse_bool(name, v);
  else if (name == "dsa_head_probs") dsa_head_probs = parse_bool(name, v);
  else if (name == "dsa_sparse_prefill") dsa_sparse_prefill = parse_bool(name, v);
  else if (name == "dsa_fold_q_max_rows") dsa_fold_q_max_rows = parse_int(name, v, 0, 1 << 20);
  else if (name == "dsa_fold_o_max_rows") dsa_fold_o_max_rows = parse_int(name, v, 0, 1 << 20);
  else if (name == "topk_max_blocks") topk_max_blocks = static_cast<int>(parse_int(name, v, 0, 16));
  else if (name == "gemv_chain_slots") gemv_chain_slots = static_cast<int>(parse_int(name, v, 0, 64));
  else if (name == "pdl") pdl = parse_bool(name, v);
  else if (name == "pdl_off") pdl_off = split_list(v);
  else throw Error(cat("unknown decode option '", name, "' (known: ", join(names()), ")"));
}

std::vector<std::string> DecodeOptions::describe() const {
  auto b = [](bool on) { return std::string(on ? "1" : "0"); };
  return {"fused=" + b(fused),
          "fused_gemv=" + b(fused_gemv),
          "gemv_chain=" + b(gemv_chain),
          cat("chained_tail_max_rows=", chained_tail_max_rows),
          "gdn_early_state=" + b(gdn_early_state),
          "delta_rule_scan=" + b(delta_rule_scan),
          cat("scan_value_block=", scan_value_block),
          "short_conv=" + b(short_conv),
          "row_norm=" + b(row_norm),
          "norm_products_dtype=" + b(norm_products_dtype),
          "residual_norm=" + b(residual_norm),
          "gated_product=" + b(gated_product),
          "cross_entropy_kernel=" + b(cross_entropy_kernel),
          "rope=" + b(rope),
          "delta_rule_prepare=" + b(delta_rule_prepare),
          "gated_linear_prepare=" + b(gated_linear_prepare),
          "channel_gate_prepare=" + b(channel_gate_prepare),
          "delta_rule_output=" + b(delta_rule_output),
          "delta_rule_output_backward=" + b(delta_rule_output_backward),
          "window_flash=" + b(window_flash),
          "channel_scores=" + b(channel_scores),
          "channel_score_rows=" + b(channel_score_rows),
          "channel_score_pairs=" + b(channel_score_pairs),
          "scan_backward_products=" + b(scan_backward_products),
          "shared_slice_gradients=" + b(shared_slice_gradients),
          "chunk_gate=" + b(chunk_gate),
          "log_sigmoid_gate=" + b(log_sigmoid_gate),
          "scale_heads=" + b(scale_heads),
          "delta_rule_gates=" + b(delta_rule_gates),
          cat("gated_prefix_chunks=", gated_prefix_chunks),
          "gated_sum=" + b(gated_sum),
          "nsa_selection_kernels=" + b(nsa_selection_kernels),
          "dsa_index_kernels=" + b(dsa_index_kernels),
          "dsa_head_probs=" + b(dsa_head_probs),
          "dsa_sparse_prefill=" + b(dsa_sparse_prefill),
          cat("dsa_fold_q_max_rows=", dsa_fold_q_max_rows),
          cat("dsa_fold_o_max_rows=", dsa_fold_o_max_rows),
          cat("topk_max_blocks=", topk_max_blocks),
          cat("gemv_chain_slots=", gemv_chain_slots),
          "pdl=" + b(pdl),
          "pdl_off=" + join(pdl_off)};
}

const DecodeOptions& decode_options() { return *current; }

bool fused_decode_enabled() { return fused_decode_available() && decode_options().fused; }

DecodeOptionsGuard::DecodeOptionsGuard(const DecodeOptions& options) : previous_(current) { current = &options; }
DecodeOptionsGuard::~DecodeOptionsGuard() { current = previous_; }

}  // namespace lt2
