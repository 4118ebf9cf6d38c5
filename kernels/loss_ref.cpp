#include <climits>
#include <cmath>
#include <limits>

#include "engine/core/error.h"
#include "kernels/loss.h"

namespace cudp::kernels {

namespace detail {

void check_rows(const char* op, int n, int classes) {
  CUDP_CHECK(n >= 0, op, ": batch size must be >= 0, got ", n);
  CUDP_CHECK(classes >= 1, op, ": number of classes must be >= 1, got ", classes);
  CUDP_CHECK(int64_t(n) * classes <= INT32_MAX, op, ": ", n, " x ", classes,
             " logits exceed the 2^31 - 1 elements supported");
}

void check_cross_entropy(const char* op, int n, int classes) {
  CUDP_CHECK(n >= 1, op,
             ": batch size must be >= 1 (the mean over an empty batch is undefined), got ", n);
  check_rows(op, n, classes);
}

}  // namespace detail

namespace {
bool label_ok(int32_t label, int classes) {
  return label >= 0 && label < classes;
}
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
}  // namespace

template <typename T>
void softmax_cross_entropy_forward_cpu(const T* logits, const int32_t* labels,
                                       std::type_identity_t<T>* loss,
                                       std::type_identity_t<T>* probs, int n, int classes,
                                       int* bad_label) {
  detail::check_cross_entropy("softmax_cross_entropy_forward", n, classes);
  double total = 0;
  for (int i = 0; i < n; ++i) {
    const T* row = logits + int64_t(i) * classes;
    double max = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < classes; ++j) max = std::fmax(max, double(row[j]));
    double sum = 0;
    for (int j = 0; j < classes; ++j) sum += std::exp(double(row[j]) - max);
    const double log_sum = std::log(sum);
    for (int j = 0; j < classes; ++j) {
      probs[int64_t(i) * classes + j] = T(std::exp(double(row[j]) - max - log_sum));
    }
    if (label_ok(labels[i], classes)) {
      total += log_sum - (double(row[labels[i]]) - max);
    } else {
      total += kNaN;
      if (bad_label) *bad_label = 1;
    }
  }
  *loss = T(total / n);
}

template <typename T>
void softmax_cross_entropy_backward_cpu(const T* probs, const int32_t* labels,
                                        std::type_identity_t<T>* dlogits, int n, int classes,
                                        std::type_identity_t<T> grad_scale) {
  detail::check_cross_entropy("softmax_cross_entropy_backward", n, classes);
  const double scale = double(grad_scale) / n;
  for (int i = 0; i < n; ++i) {
    const bool ok = label_ok(labels[i], classes);
    for (int j = 0; j < classes; ++j) {
      const int64_t e = int64_t(i) * classes + j;
      const double onehot = ok && j == labels[i] ? 1.0 : 0.0;
      dlogits[e] = T(ok ? (double(probs[e]) - onehot) * scale : kNaN);
    }
  }
}

void argmax_rows_cpu(const float* x, int32_t* out, int n, int classes) {
  detail::check_rows("argmax_rows", n, classes);
  for (int i = 0; i < n; ++i) {
    const float* row = x + int64_t(i) * classes;
    int32_t best = 0;
    for (int j = 1; j < classes; ++j) {
      if (std::isnan(row[best])) break;  // the first NaN is final
      if (row[j] > row[best] || std::isnan(row[j])) best = j;
    }
    out[i] = best;
  }
}

void count_correct_cpu(const int32_t* pred, const int32_t* labels, int n, int* count) {
  CUDP_CHECK(n >= 0, "count_correct: n must be >= 0, got ", n);
  int hits = 0;
  for (int i = 0; i < n; ++i) hits += pred[i] == labels[i];
  *count = hits;
}

template void softmax_cross_entropy_forward_cpu<float>(const float*, const int32_t*, float*, float*,
                                                       int, int, int*);
template void softmax_cross_entropy_forward_cpu<double>(const double*, const int32_t*, double*,
                                                        double*, int, int, int*);
template void softmax_cross_entropy_backward_cpu<float>(const float*, const int32_t*, float*, int,
                                                        int, float);
template void softmax_cross_entropy_backward_cpu<double>(const double*, const int32_t*, double*,
                                                         int, int, double);

}  // namespace cudp::kernels
