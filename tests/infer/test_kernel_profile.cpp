// lt2 bench decode --profile: kernel names shortened the way the table shows them, device
// activity summed by name, sorted by time, with busy time, span and gaps per step; and the
// profiler itself on the CPU (no CUDA activity to record: an empty profile, no error).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "lt2/infer/kernel_profile.h"
#include "lt2/util/error.h"

using namespace lt2;

TEST(KernelProfile, ShortNamesDropReturnTypeTemplatesParametersAndAnonymousNamespaces) {
  EXPECT_EQ(short_kernel_name("void lt2::kernels::(anonymous namespace)::gemv_mma_kernel<__nv_bfloat16, "
                              "(lt2::kernels::GemvPrologue)1>(lt2::kernels::GemvParams)"),
            "lt2::kernels::gemv_mma_kernel");
  EXPECT_EQ(short_kernel_name("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous "
                              "namespace)::foo<float>, std::array<char*, 2ul> >(int, float, char*)"),
            "at::native::vectorized_elementwise_kernel");
  EXPECT_EQ(short_kernel_name("Memcpy DtoD (Device -> Device)"), "Memcpy DtoD");
}

TEST(KernelProfile, GenericKernelsNameWhatTheyRun) {
  EXPECT_EQ(short_kernel_name("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
                              "silu_kernel(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#2}::"
                              "operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, "
                              "at::native::(anonymous namespace)::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}, "
                              "std::array<char*, 2ul>)"),
            "at::native::vectorized_elementwise_kernel [silu_kernel bf16]");
  EXPECT_EQ(short_kernel_name("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<floa"
                              "t, float, "
                              "float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, "
                              "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor"
                              "<float> >, std::array<char*, 3ul>)"),
            "at::native::vectorized_elementwise_kernel [MulFunctor fp32]");
  EXPECT_EQ(short_kernel_name("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<a"
                              "t::native::"
                              "index_kernel_impl<at::native::OpaqueType<2> >(at::TensorIteratorBase&, c10::Arra"
                              "yRef<long>, "
                              "c10::ArrayRef<long>)::{lambda(char*, char const*, long)#1}>(at::TensorIteratorBase&, "
                              "c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(int)#1}>(long, {lambda(int)#1})"),
            "at::native::index_elementwise_kernel [index_kernel_impl]");
  EXPECT_EQ(short_kernel_name("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<a"
                              "t::native::"
                              "BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::"
                              "MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<c10::BFloat16, "
                              "c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > const&)::"
                              "{lambda(int)#1}>(int, {lambda(int)#1})"),
            "at::native::elementwise_kernel [MulFunctor bf16]");
  EXPECT_EQ(short_kernel_name("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nn_align1>(cutlass_80_simt_sgemm_"
                              "128x64_8x5_nn_align1::Params)"),
            "cutlass::Kernel2 [cutlass_80_simt_sgemm_128x64_8x5_nn_align1]");
  EXPECT_EQ(short_kernel_name("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT"), "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT");
}

TEST(KernelProfile, KernelsAreListedPerLaunchingOperator) {
  EXPECT_EQ(operator_label("aten::copy_", {{8, 4096, 192}, {8, 4096, 192}}, {"BFloat16", "float"}),
            "aten::copy_ [8, 4096, 192] BFloat16");
  EXPECT_EQ(operator_label("aten::mm", {}, {}), "aten::mm");
  const auto p = summarize_activity({{"void a<int>(int)", 3.0, "aten::mul [4] float"},
                                     {"void a<int>(int)", 5.0, "aten::add [4] float"},
                                     {"void a<float>(float)", 4.0, "aten::mul [4] float"}},
                                    /*steps=*/1, /*span_us=*/20.0);
  ASSERT_EQ(p.kernels.size(), 2u);
  EXPECT_EQ(p.kernels[0].name, "a <- aten::mul [4] float");
  EXPECT_EQ(p.kernels[0].calls, 2);
  EXPECT_DOUBLE_EQ(p.kernels[0].total_us, 7.0);
  EXPECT_EQ(p.kernels[1].name, "a <- aten::add [4] float");
}

TEST(KernelProfile, SummarySumsByNameAndSortsByTime) {
  const auto p = summarize_activity({{"void a<int>(int)", 3.0, ""}, {"void b(float)", 10.0, ""},
                                     {"void a<float>(float)", 4.0, ""}},
                                    /*steps=*/2, /*span_us=*/25.0);
  ASSERT_EQ(p.kernels.size(), 2u);
  EXPECT_EQ(p.kernels[0].name, "b");
  EXPECT_EQ(p.kernels[1].name, "a");
  EXPECT_EQ(p.kernels[1].calls, 2);
  EXPECT_DOUBLE_EQ(p.kernels[1].total_us, 7.0);
  EXPECT_DOUBLE_EQ(p.busy_us, 17.0);
  const auto j = p.to_json(10);
  EXPECT_DOUBLE_EQ(j["busy_us_per_step"].get<double>(), 8.5);
  EXPECT_DOUBLE_EQ(j["span_us_per_step"].get<double>(), 12.5);
  EXPECT_DOUBLE_EQ(j["kernels"][1]["calls_per_step"].get<double>(), 1.0);
  const auto table = kernel_profile_table(p, 1);  // the top kernel only
  EXPECT_NE(table.find("12.5 us from first kernel start to last end, 8.5 us busy (68%), 4.0 us of gaps"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("| b | 0.5 | 5.0 | 58.8% |"), std::string::npos) << table;
  EXPECT_EQ(table.find("| a |"), std::string::npos) << table;
  EXPECT_THROW(summarize_activity({}, 0, 0), Error);
  // Overlapping kernels: busy 17 us in a 10 us span.
  const auto overlapping = kernel_profile_table(
      summarize_activity({{"void a<int>(int)", 7.0, ""}, {"void b(float)", 10.0, ""}}, 1, 10.0), 5);
  EXPECT_NE(overlapping.find("17.0 us busy (170%), kernels overlap by 7.0 us"), std::string::npos) << overlapping;
}

TEST(KernelProfile, StepsThatLaunchNothingGiveAnEmptyProfile) {
  int calls = 0;
  const auto p = profile_device_activity([&] { ++calls; }, 3);
  EXPECT_EQ(p.steps, 0);  // no device activity recorded
  EXPECT_TRUE(p.kernels.empty());
  EXPECT_EQ(calls, torch::cuda::is_available() ? 3 : 0);  // without CUDA nothing is profiled or run
  EXPECT_EQ(kernel_profile_table(p, 5), "no device activity recorded\n");
  EXPECT_THROW(profile_device_activity([] {}, 0), Error);
}
