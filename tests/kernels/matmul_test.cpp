// Host tests of the tensor-core matmul's CPU side (kernels/matmul.h): the reference against products
// worked out by hand, and the plan arithmetic (no empty split, a grid no larger than the work).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "engine/core/error.h"
#include "kernels/layout.h"
#include "kernels/matmul.h"

namespace cudp::kernels {
namespace {

TEST(MatmulCpu, SmallProductWithEveryEpilogueTerm) {
  // A = [[1, 2], [3, 4]], B = [[1, 0], [-1, 1]] (n x k): A B^T = [[1, 1], [3, 1]].
  const std::vector<float> a = {1, 2, 3, 4}, b = {1, 0, -1, 1}, bias = {10, -20};
  std::vector<float> c = {1, 2, 3, 4};
  MatmulProblem p;
  p.m = p.n = p.k = 2;
  p.math = Math::TF32;
  p.a = a.data();
  p.lda = 2;
  p.b = b.data();
  p.ldb = 2;
  p.c = c.data();
  p.ldc = 2;
  p.alpha = 2.f;
  p.beta = 0.5f;
  p.bias = bias.data();
  p.relu = true;
  matmul_cpu(p);
  // 2*[[1,1],[3,1]] + 0.5*[[1,2],[3,4]] + [10,-20] -> [[12.5, -17], [17.5, -16]] -> relu.
  EXPECT_EQ(c, (std::vector<float>{12.5f, 0.f, 17.5f, 0.f}));
}

TEST(MatmulCpu, BStoredKByN) {
  // A = [[1, 2, 3]] (1 x 3), B stored k x n = [[1, 0], [2, -1], [0, 4]] with one padding column
  // (ldb 3): C = A B = [[5, 10]].
  const float pad = 1e30f;
  const std::vector<float> a = {1, 2, 3}, b = {1, 0, pad, 2, -1, pad, 0, 4, pad};
  std::vector<uint16_t> a16(3), b16(9), c(2, 0xFFFF);
  for (int i = 0; i < 3; ++i) a16[i] = detail::f32_to_bf16_bits(a[i]);
  for (int i = 0; i < 9; ++i) b16[i] = detail::f32_to_bf16_bits(b[i]);
  MatmulProblem p;
  p.m = 1;
  p.n = 2;
  p.k = 3;
  p.math = Math::BF16;
  p.a = a16.data();
  p.lda = 3;
  p.b = b16.data();
  p.ldb = 3;
  p.b_transposed = true;
  p.c = c.data();
  p.ldc = 2;
  p.c_type = DType::BF16;
  matmul_cpu(p);
  EXPECT_EQ(c[0], detail::f32_to_bf16_bits(5.f));
  EXPECT_EQ(c[1], detail::f32_to_bf16_bits(10.f));
}

TEST(MatmulCpu, BothOperandsStoredKMajorLast) {
  // A stored k x m = [[1, 2], [3, 4], [5, 6]] (A^T = [[1, 3, 5], [2, 4, 6]]), B stored k x n =
  // [[1], [0], [-1]]: C = A^T B = [[-4], [-4]], accumulated into C = [[1], [2]] with beta 1.
  std::vector<uint16_t> a(6), b(3);
  const float av[] = {1, 2, 3, 4, 5, 6}, bv[] = {1, 0, -1};
  for (int i = 0; i < 6; ++i) a[i] = detail::f32_to_bf16_bits(av[i]);
  for (int i = 0; i < 3; ++i) b[i] = detail::f32_to_bf16_bits(bv[i]);
  std::vector<float> c = {1, 2};
  MatmulProblem p;
  p.m = 2;
  p.n = 1;
  p.k = 3;
  p.math = Math::BF16;
  p.a = a.data();
  p.lda = 2;
  p.a_transposed = true;
  p.b = b.data();
  p.ldb = 1;
  p.b_transposed = true;
  p.c = c.data();
  p.ldc = 1;
  p.beta = 1.f;
  matmul_cpu(p);
  EXPECT_EQ(c, (std::vector<float>{-3.f, -2.f}));
}

TEST(MatmulCpu, Bf16OperandsAndOutput) {
  const std::vector<float> values = {1.5f, -2.f, 0.25f, 3.f};
  std::vector<uint16_t> a(4), b(4), c(4, 0xFFFF);  // C starts as NaN: beta = 0 must not read it
  for (int i = 0; i < 4; ++i) a[i] = b[i] = detail::f32_to_bf16_bits(values[i]);
  MatmulProblem p;
  p.m = p.n = p.k = 2;
  p.math = Math::BF16;
  p.a = a.data();
  p.lda = 2;
  p.b = b.data();
  p.ldb = 2;
  p.c = c.data();
  p.ldc = 2;
  p.c_type = DType::BF16;
  matmul_cpu(p);
  // [[1.5,-2],[0.25,3]] times its transpose: [[6.25, -5.625], [-5.625, 9.0625]] (exact in bf16).
  const std::vector<float> want = {6.25f, -5.625f, -5.625f, 9.0625f};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(c[i], detail::f32_to_bf16_bits(want[i])) << i;
}

TEST(MatmulPlan, SplitsAreNeverEmptyAndTheGridFitsTheWork) {
  for (Math math : {Math::BF16, Math::TF32}) {
    for (int k : {1, 31, 32, 64, 65, 1000, 25088}) {
      for (int splits : {1, 2, 7, 16, 100}) {
        MatmulProblem p;
        p.m = 300;
        p.n = 200;
        p.k = k;
        p.math = math;
        const MatmulPlan plan = make_matmul_plan(p, 128, splits, 132);
        const int k_block = math == Math::BF16 ? 64 : 32;
        const int blocks = (k + k_block - 1) / k_block;
        EXPECT_GE(plan.splits, 1);
        EXPECT_LE(plan.splits, splits);
        EXPECT_LT((plan.splits - 1) * plan.k_blocks_per_split, blocks) << "an empty split";
        EXPECT_GE(plan.splits * plan.k_blocks_per_split, blocks) << "k not covered";
        EXPECT_LE(plan.grid, 3 * 2 * plan.splits);
        EXPECT_EQ(matmul_workspace_bytes(p, plan),
                  plan.splits > 1 ? int64_t(plan.splits) * 300 * 200 * 4 : 0);
      }
    }
  }
  MatmulProblem p;
  p.k = 10;
  EXPECT_THROW(make_matmul_plan(p, 96, 1, 132), ValueError);
  EXPECT_THROW(make_matmul_plan(p, 128, 0, 132), ValueError);
}

}  // namespace
}  // namespace cudp::kernels
