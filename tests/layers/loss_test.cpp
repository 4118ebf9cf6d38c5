// Host tests of CrossEntropyLoss (values worked out by hand, finite differences, chunk weighting,
// bad labels), argmax and correct counting.
#include "layers/loss.h"

#include <gtest/gtest.h>

#include <cmath>

#include "common/compare.h"

namespace cudp {
namespace {

using testing::all_close;
using testing::random_vector;

Tensor floats(const std::vector<float>& v, const Shape& shape) {
  return Tensor::from_vector(v, shape);
}
Tensor ints(const std::vector<int32_t>& v) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
}

// -log softmax(row)[label], in double, straight from the definition.
double row_loss(const std::vector<float>& logits, int row, int classes, int label) {
  double sum = 0;
  for (int j = 0; j < classes; ++j) sum += std::exp(double(logits[row * classes + j]));
  return std::log(sum) - logits[row * classes + label];
}

TEST(CrossEntropyLoss, ValuesWorkedOutByHand) {
  CrossEntropyLoss criterion;
  // Two equal logits: -log(1/2) = ln 2.
  Tensor loss = criterion.forward(floats({3.f, 3.f}, {1, 2}), ints({1}));
  EXPECT_EQ(loss.shape(), Shape{});
  EXPECT_NEAR(loss.to_vector<float>()[0], std::log(2.0), 1e-7);
  EXPECT_NEAR(criterion.item(), std::log(2.0), 1e-7);

  // logits [[1, 2, 3], [1, 1, 1]], labels [2, 0]:
  //   row 0: log(e + e^2 + e^3) - 3 = 0.40760596444
  //   row 1: log 3 = 1.09861228867;   mean 0.75310912655
  criterion.forward(floats({1, 2, 3, 1, 1, 1}, {2, 3}), ints({2, 0}));
  EXPECT_NEAR(criterion.item(), 0.75310912655, 1e-6);
}

TEST(CrossEntropyLoss, IsStableForLargeLogits) {
  CrossEntropyLoss criterion;
  criterion.forward(floats({1000.f, 0.f, -1000.f}, {1, 3}), ints({1}));
  EXPECT_NEAR(criterion.item(), 1000.0, 1e-3);  // exp(1000) would overflow without the max shift
}

TEST(CrossEntropyLoss, MatchesTheDefinitionOnRandomLogits) {
  const int n = 7, classes = 5;
  const std::vector<float> logits = random_vector(n * classes, 1, -3.f, 3.f);
  const std::vector<int32_t> labels = {0, 4, 2, 2, 1, 3, 4};
  CrossEntropyLoss criterion;
  criterion.forward(floats(logits, {n, classes}), ints(labels));
  double mean = 0;
  for (int i = 0; i < n; ++i) mean += row_loss(logits, i, classes, labels[i]) / n;
  EXPECT_NEAR(criterion.item(), mean, 1e-6 * std::fabs(mean));

  // backward: (softmax - onehot) / n.
  std::vector<double> expected(n * classes);
  for (int i = 0; i < n; ++i) {
    double sum = 0;
    for (int j = 0; j < classes; ++j) sum += std::exp(double(logits[i * classes + j]));
    for (int j = 0; j < classes; ++j) {
      expected[i * classes + j] =
          (std::exp(double(logits[i * classes + j])) / sum - (j == labels[i])) / n;
    }
  }
  const Tensor dlogits = criterion.backward();
  EXPECT_EQ(dlogits.shape(), (Shape{n, classes}));
  EXPECT_TRUE(all_close(dlogits.to_vector<float>(), expected, 1e-5, 1e-7));
}

TEST(CrossEntropyLoss, GradientMatchesFiniteDifferences) {
  const int n = 3, classes = 4;
  std::vector<float> logits = random_vector(n * classes, 2, -2.f, 2.f);
  const std::vector<int32_t> labels = {3, 0, 1};
  CrossEntropyLoss criterion;
  criterion.forward(floats(logits, {n, classes}), ints(labels));
  const std::vector<float> analytic = criterion.backward().to_vector<float>();

  // Central differences of the loss, evaluated in double from the definition (the float loss's
  // rounding would dominate a step small enough to be accurate).
  auto mean_loss = [&](const std::vector<float>& x) {
    double total = 0;
    for (int i = 0; i < n; ++i) total += row_loss(x, i, classes, labels[i]);
    return total / n;
  };
  const float h = 1e-2f;
  std::vector<double> numeric(logits.size());
  for (size_t e = 0; e < logits.size(); ++e) {
    std::vector<float> plus = logits, minus = logits;
    plus[e] += h;
    minus[e] -= h;
    numeric[e] = (mean_loss(plus) - mean_loss(minus)) / (double(plus[e]) - double(minus[e]));
  }
  EXPECT_TRUE(all_close(analytic, numeric, 1e-3, 1e-6));
}

TEST(CrossEntropyLoss, ChunkWeightsReproduceTheWholeBatch) {
  // A batch of 5 split 3 + 2 (uneven, as torch.chunk splits for two replicas).
  const int n = 5, classes = 3;
  const std::vector<float> logits = random_vector(n * classes, 3, -2.f, 2.f);
  const std::vector<int32_t> labels = {2, 0, 1, 1, 0};
  const Tensor all = floats(logits, {n, classes});
  CrossEntropyLoss whole;
  whole.forward(all, ints(labels));
  const std::vector<float> full_grad = whole.backward().to_vector<float>();

  CrossEntropyLoss first, second;
  first.forward(all.slice(0, 3), ints({2, 0, 1}), CrossEntropyLoss::chunk_weight(3, n));
  second.forward(all.slice(3, 5), ints({1, 0}), CrossEntropyLoss::chunk_weight(2, n));
  EXPECT_NEAR(first.item() + second.item(), whole.item(), 1e-6);
  std::vector<float> chunked = first.backward().to_vector<float>();
  const std::vector<float> tail = second.backward().to_vector<float>();
  chunked.insert(chunked.end(), tail.begin(), tail.end());
  EXPECT_TRUE(all_close(chunked, full_grad, 1e-6, 1e-8));
}

TEST(CrossEntropyLoss, GradScaleScalesTheGradient) {
  CrossEntropyLoss criterion;
  criterion.forward(floats({0.5f, -1.f, 2.f, 0.f}, {2, 2}), ints({0, 1}));
  std::vector<float> once = criterion.backward(1.0).to_vector<float>();
  const std::vector<float> thrice = criterion.backward(3.0).to_vector<float>();
  for (float& g : once) g *= 3.f;
  EXPECT_TRUE(all_close(thrice, once, 1e-6, 0));
}

// The error for a bad label names its value, its index and the class count.
void expect_bad_label(const std::function<void()>& run, const std::string& value,
                      const std::string& index, const std::string& classes) {
  try {
    run();
    ADD_FAILURE() << "expected ValueError";
  } catch (const ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("Target " + value + " is out of bounds"), std::string::npos) << what;
    EXPECT_NE(what.find("index " + index), std::string::npos) << what;
    EXPECT_NE(what.find(classes + " classes"), std::string::npos) << what;
  }
}

TEST(CrossEntropyLoss, RejectsLabelsOutOfRange) {
  CrossEntropyLoss criterion;
  const Tensor logits = floats(random_vector(9, 4), {3, 3});
  expect_bad_label([&] { criterion.forward(logits, ints({0, 2, 3})); }, "3", "2", "3");
  expect_bad_label([&] { criterion.forward(logits, ints({-1, 0, 0})); }, "-1", "0", "3");
  expect_bad_label([&] { check_label_range(ints({1, 9}), 5); }, "9", "1", "5");
  EXPECT_NO_THROW(check_label_range(ints({0, 4}), 5));
}

TEST(CrossEntropyLoss, RejectsBadShapesAndTypes) {
  CrossEntropyLoss criterion;
  const Tensor logits = Tensor::zeros({2, 3});
  EXPECT_THROW(criterion.forward(Tensor::zeros({6}), ints({0, 1})), ValueError);
  EXPECT_THROW(criterion.forward(logits, ints({0, 1, 2})), ValueError);
  EXPECT_THROW(criterion.forward(logits, Tensor::zeros({2})), ValueError);  // f32 labels
  EXPECT_THROW(criterion.forward(Tensor::zeros({0, 3}), ints({})), ValueError);
  EXPECT_THROW(CrossEntropyLoss().item(), ValueError);
  EXPECT_THROW(CrossEntropyLoss().backward(), ValueError);
  EXPECT_THROW(CrossEntropyLoss::chunk_weight(3, 2), ValueError);
}

TEST(Argmax, PicksTheFirstMaximumPerRow) {
  const float nan = std::nanf("");
  const Tensor x = floats({1, 5, 5, 0,       // a tie: the first index
                           -3, -2, -9, -1,   // all negative
                           2, nan, 7, nan},  // NaN counts as the maximum
                          {3, 4});
  const Tensor pred = argmax(x, 1);
  EXPECT_EQ(pred.dtype(), DType::i32);
  EXPECT_EQ(pred.to_vector<int32_t>(), (std::vector<int32_t>{1, 3, 1}));
  EXPECT_EQ(argmax(x, -1).to_vector<int32_t>(), pred.to_vector<int32_t>());
  EXPECT_THROW(argmax(x, 0), ValueError);
  EXPECT_THROW(argmax(Tensor::zeros({4}), 1), ValueError);
}

TEST(CountCorrect, CountsMatchesWithoutSynchronising) {
  const Tensor count = count_correct(ints({0, 1, 2, 3}), ints({0, 2, 2, 3}));
  EXPECT_EQ(count.shape(), Shape{});
  EXPECT_EQ(count.to_vector<int32_t>()[0], 3);
  EXPECT_EQ(num_correct(floats({1, 0, 0, 1, 3, 2}, {3, 2}), ints({0, 0, 0})), 2);
  EXPECT_THROW(count_correct(ints({0, 1}), ints({0})), ValueError);
}

}  // namespace
}  // namespace cudp
