#include "lt2/train/gradient_reducer.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>

#include "lt2/util/error.h"

namespace lt2 {

struct GradientBuckets::State {
  struct Param {
    std::string name;
    torch::Tensor tensor;
    std::shared_ptr<torch::autograd::Node> accumulator;  // held, so autograd keeps using this node
    uintptr_t hook = 0;
    int runs = 0;          // runs of the accumulator in the current last backward
    int expected = 0;      // runs counted in the first step (0: not reduced)
    int64_t final_at = -1;  // counting step: when the last run happened
    int64_t bucket = -1, offset = 0;
  };
  struct Bucket {
    std::vector<size_t> members;
    torch::Tensor flat;  // [sum of the members' numel]
    size_t pending = 0;  // members not yet final in this backward
    c10::intrusive_ptr<c10d::Work> work;
  };

  std::shared_ptr<ProcessGroup> group;
  int64_t bucket_bytes = 0;
  std::vector<Param> params;
  std::vector<Bucket> buckets;
  size_t next_bucket = 0;  // buckets launch in order, so every rank issues the same collectives
  bool armed = false, counted = false;
  int64_t clock = 0;
  std::mutex mu;

  void on_accumulated(size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    if (!armed) return;
    Param& p = params[i];
    ++p.runs;
    if (!counted) {
      p.final_at = clock++;
      return;
    }
    LT2_CHECK(p.runs <= p.expected, group->who(), ": parameter '", p.name, "' got ", p.runs,
              " gradient contributions in one backward, ", p.expected, " in the first step: the model's graph "
              "changed between steps, which the overlapped gradient all-reduce cannot follow");
    if (p.runs < p.expected) return;
    copy_in(i);
    if (--buckets[p.bucket].pending == 0) launch_ready();
  }

  void copy_in(size_t i) {
    Param& p = params[i];
    auto slot = buckets[p.bucket].flat.narrow(0, p.offset, p.tensor.numel());
    if (p.tensor.grad().defined()) slot.copy_(p.tensor.grad().reshape({-1}));
    else slot.zero_();
  }

  void launch(size_t b) {
    buckets[b].work = group->start_all_reduce_sum(buckets[b].flat);
  }

  void launch_ready() {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) launch(next_bucket++);
  }

  // After the counting step: buckets in the order gradients became final on rank 0, each of one
  // dtype and at most bucket_bytes (or one larger parameter).
  void build_buckets() {
    const int64_t n = static_cast<int64_t>(params.size());
    std::vector<int64_t> order;
    for (int64_t i = 0; i < n; ++i)
      if (params[i].runs > 0) order.push_back(i);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return params[a].final_at < params[b].final_at; });
    order.resize(n, -1);
    auto shared = torch::tensor(order, torch::kLong).to(group->device());
    group->broadcast(shared, 0, "gradient bucket order");
    order.assign(n, -1);
    shared = shared.cpu();
    std::copy_n(shared.data_ptr<int64_t>(), n, order.begin());

    std::vector<bool> reduced(n, false);
    int64_t open_bytes = 0, open_numel = 0;
    for (int64_t i : order) {
      if (i < 0) break;
      Param& p = params[i];
      reduced[i] = true;
      p.expected = std::max(p.runs, 1);  // rank 0 saw a gradient; this rank contributes zeros if it did not
      const int64_t bytes = p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
      const bool same_kind = !buckets.empty() && params[buckets.back().members.front()].tensor.options().dtype() ==
                                                     p.tensor.options().dtype();
      if (!same_kind || (open_bytes > 0 && open_bytes + bytes > bucket_bytes)) {
        buckets.emplace_back();
        open_bytes = open_numel = 0;
      }
      p.bucket = static_cast<int64_t>(buckets.size()) - 1;
      p.offset = open_numel;
      open_numel += p.tensor.numel();
      open_bytes += bytes;
      buckets.back().members.push_back(static_cast<size_t>(i));
    }
    for (int64_t i = 0; i < n; ++i)
      LT2_CHECK(reduced[i] || params[i].runs == 0, group->who(), ": parameter '", params[i].name,
                "' got a gradient on this rank but not on rank 0: the ranks run different graphs");
    for (auto& b : buckets) {
      int64_t numel = 0;
      for (size_t m : b.members) numel += params[m].tensor.numel();
      b.flat = torch::empty({numel}, params[b.members.front()].tensor.options().requires_grad(false));
    }
  }
};

GradientBuckets::GradientBuckets(std::shared_ptr<ProcessGroup> group,
                                 const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                 int64_t bucket_bytes)
    : s_(std::make_unique<State>()) {
  LT2_CHECK(bucket_bytes > 0, "gradient bucket size must be > 0 bytes, found ", bucket_bytes);
  s_->group = std::move(group);
  s_->bucket_bytes = bucket_bytes;
  for (const auto& [name, t] : params) {
    if (!t.requires_grad()) continue;
    State::Param p;
    p.name = name;
    p.tensor = t;
    p.accumulator = torch::autograd::impl::grad_accumulator(t);
    s_->params.push_back(std::move(p));
  }
  // A post hook on AccumulateGrad runs once .grad holds that run's contribution.
  struct Hook : torch::autograd::FunctionPostHook {
    State* state;
    size_t index;
    Hook(State* s, size_t i) : state(s), index(i) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      state->on_accumulated(index);
      return outputs;
    }
  };
  for (size_t i = 0; i < s_->params.size(); ++i)
    s_->params[i].hook = s_->params[i].accumulator->add_post_hook(std::make_unique<Hook>(s_.get(), i));
}

GradientBuckets::~GradientBuckets() {
  for (auto& p : s_->params) p.accumulator->del_post_hook(p.hook);
}

int64_t GradientBuckets::num_buckets() const { return static_cast<int64_t>(s_->buckets.size()); }

void GradientBuckets::begin_last_backward() {
  std::lock_guard<std::mutex> lock(s_->mu);
  for (auto& p : s_->params) p.runs = 0;
  for (auto& b : s_->buckets) {
    b.pending = b.members.size();
    b.work.reset();
  }
  s_->next_bucket = 0;
  s_->clock = 0;
  s_->armed = true;
}

void GradientBuckets::finish(int64_t step) {
  std::unique_lock<std::mutex> lock(s_->mu);
  LT2_CHECK(s_->armed, "GradientBuckets::finish without begin_last_backward");
  s_->armed = false;
  const std::string what = cat("gradient all-reduce (step ", step, ")");
  const bool counting = !s_->counted;
  if (counting) {
    s_->build_buckets();
    s_->counted = true;
  }
  // What backward left: everything in the counting step; otherwise the members whose gradient came
  // fewer times than counted (or not at all), final now.
  for (size_t b = s_->next_bucket; b < s_->buckets.size(); ++b)
    for (size_t m : s_->buckets[b].members)
      if (counting || s_->params[m].runs < s_->params[m].expected) s_->copy_in(m);
  while (s_->next_bucket < s_->buckets.size()) s_->launch(s_->next_bucket++);
  for (auto& b : s_->buckets) {
    s_->group->wait(b.work, what);
    b.work.reset();
  }
  for (auto& b : s_->buckets) {
    for (size_t m : b.members) {
      auto& p = s_->params[m];
      auto sum = b.flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes());
      if (p.tensor.grad().defined()) p.tensor.mutable_grad().copy_(sum);
      else p.tensor.mutable_grad() = sum.clone();
    }
  }
}

}  // namespace lt2
