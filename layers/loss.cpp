#include "layers/loss.h"

#include <cmath>
#include <cstring>

#include "kernels/elementwise.h"
#include "kernels/loss.h"

namespace cudp {
namespace {

// The kernels take int sizes; the loss kernels check n * classes against their limit.
int as_int(int64_t n, const char* what) {
  CUDP_CHECK(n <= INT32_MAX, "CrossEntropyLoss: ", what, " ", n, " exceeds 2^31 - 1");
  return static_cast<int>(n);
}

void check_range(const int32_t* labels, int64_t n, int64_t classes) {
  for (int64_t i = 0; i < n; ++i) {
    CUDP_CHECK(labels[i] >= 0 && labels[i] < classes, "CrossEntropyLoss: Target ", labels[i],
               " is out of bounds: the label at index ", i, " is not in [0, ", classes, ") for ",
               classes, " classes");
  }
}

void check_labels_tensor(const Tensor& labels, const Tensor& like, int64_t n, const char* op) {
  check_device(labels, like.device(), op);
  CUDP_CHECK(labels.dtype() == DType::i32, op,
             " must be i32 (class indices as int32_t, where PyTorch uses int64: "
             "Tensor::from_vector<int32_t>), got ",
             labels.str());
  check_shape(labels, {n}, op);
}

}  // namespace

void check_label_range(const Tensor& labels, int64_t classes) {
  CUDP_CHECK(
      labels.defined() && labels.is_cpu() && labels.dtype() == DType::i32 && labels.dim() == 1,
      "check_label_range: labels must be a 1-D i32 CPU tensor, got ", labels.str());
  check_range(labels.data<int32_t>(), labels.numel(), classes);
}

double CrossEntropyLoss::chunk_weight(int64_t chunk, int64_t batch) {
  CUDP_CHECK(batch > 0 && chunk >= 0 && chunk <= batch, "CrossEntropyLoss::chunk_weight: chunk of ",
             chunk, " samples does not fit a batch of ", batch);
  return static_cast<double>(chunk) / static_cast<double>(batch);
}

Tensor CrossEntropyLoss::forward(const Tensor& logits, const Tensor& labels, double weight) {
  CUDP_CHECK(logits.defined() && logits.dim() == 2 && logits.dtype() == DType::f32,
             "CrossEntropyLoss: logits must be a 2-D f32 tensor [N, classes], got ", logits.str());
  const int n = as_int(logits.size(0), "batch size");
  const int classes = as_int(logits.size(1), "number of classes");
  check_labels_tensor(labels, logits, n, "CrossEntropyLoss: labels");
  CUDP_CHECK(std::isfinite(weight), "CrossEntropyLoss: weight must be finite, got ", weight);

  const Device device = logits.device();
  if (device.is_cpu()) {
    check_range(labels.data<int32_t>(), n, classes);
  }
  result_ = Tensor::empty({device.is_cpu() ? 1 : 2}, DType::f32, device);
  loss_ = result_.slice(0, 1).view({});
  probs_ = Tensor::empty(logits.shape(), DType::f32, device);
  labels_ = labels;
  weight_ = weight;
  float* loss = result_.data<float>();
  on_device(
      device,
      [&] {
        kernels::softmax_cross_entropy_forward_cpu<float>(
            logits.data<float>(), labels.data<int32_t>(), loss, probs_.data<float>(), n, classes,
            nullptr);
        *loss = static_cast<float>(*loss * weight);
      },
      [&](cudaStream_t stream) {
        int* bad_label = reinterpret_cast<int*>(loss + 1);
        CUDP_CUDA_CHECK(cudaMemsetAsync(bad_label, 0, sizeof(int), stream));
        kernels::softmax_cross_entropy_forward(logits.data<float>(), labels.data<int32_t>(), loss,
                                               probs_.data<float>(), n, classes, bad_label, stream);
        if (weight != 1.0) {
          kernels::scale(loss, static_cast<float>(weight), 1, stream);
        }
      });
  return loss_;
}

Tensor CrossEntropyLoss::backward(double grad_scale) const {
  check_forward_done("backward()");
  const int n = static_cast<int>(probs_.size(0)), classes = static_cast<int>(probs_.size(1));
  const auto scale = static_cast<float>(weight_ * grad_scale);
  Tensor dlogits = Tensor::empty(probs_.shape(), DType::f32, probs_.device());
  on_device(
      probs_.device(),
      [&] {
        kernels::softmax_cross_entropy_backward_cpu<float>(
            probs_.data<float>(), labels_.data<int32_t>(), dlogits.data<float>(), n, classes,
            scale);
      },
      [&](cudaStream_t stream) {
        kernels::softmax_cross_entropy_backward(probs_.data<float>(), labels_.data<int32_t>(),
                                                dlogits.data<float>(), n, classes, scale, stream);
      });
  return dlogits;
}

float CrossEntropyLoss::item() const {
  check_forward_done("item()");
  // One copy brings the loss and, on a GPU, the bad-label flag beside it.
  const std::vector<float> words = result_.to_vector<float>();
  if (words.size() == 2) {
    int bad = 0;
    std::memcpy(&bad, &words[1], sizeof bad);
    if (bad) {
      const std::vector<int32_t> labels = labels_.to_vector<int32_t>();
      check_range(labels.data(), probs_.size(0), probs_.size(1));
    }
  }
  return words[0];
}

void CrossEntropyLoss::release() {
  result_ = Tensor();
  loss_ = Tensor();
  probs_ = Tensor();
  labels_ = Tensor();
}

void CrossEntropyLoss::check_labels() const {
  item();
}

void CrossEntropyLoss::check_forward_done(const char* what) const {
  CUDP_CHECK(result_.defined(), "CrossEntropyLoss: ", what, " called before forward()");
}

Tensor argmax(const Tensor& x, int64_t dim) {
  CUDP_CHECK(x.defined() && x.dim() == 2 && x.dtype() == DType::f32,
             "argmax: expects a 2-D f32 tensor, got ", x.str());
  CUDP_CHECK(dim == 1 || dim == -1, "argmax: only dim 1 (over each row) is supported, got ", dim);
  const int n = as_int(x.size(0), "batch size");
  const int classes = as_int(x.size(1), "number of classes");
  Tensor out = Tensor::empty({n}, DType::i32, x.device());
  on_device(
      x.device(),
      [&] { kernels::argmax_rows_cpu(x.data<float>(), out.data<int32_t>(), n, classes); },
      [&](cudaStream_t stream) {
        kernels::argmax_rows(x.data<float>(), out.data<int32_t>(), n, classes, stream);
      });
  return out;
}

Tensor count_correct(const Tensor& predictions, const Tensor& labels) {
  CUDP_CHECK(predictions.defined() && predictions.dim() == 1 && predictions.dtype() == DType::i32,
             "count_correct: predictions must be a 1-D i32 tensor, got ", predictions.str());
  const int n = as_int(predictions.size(0), "batch size");
  check_labels_tensor(labels, predictions, n, "count_correct: labels");
  Tensor count = Tensor::empty({}, DType::i32, predictions.device());
  on_device(
      predictions.device(),
      [&] {
        kernels::count_correct_cpu(predictions.data<int32_t>(), labels.data<int32_t>(), n,
                                   count.data<int32_t>());
      },
      [&](cudaStream_t stream) {
        kernels::count_correct(predictions.data<int32_t>(), labels.data<int32_t>(), n,
                               count.data<int32_t>(), stream);
      });
  return count;
}

int64_t num_correct(const Tensor& logits, const Tensor& labels) {
  return count_correct(argmax(logits, 1), labels).to_vector<int32_t>()[0];
}

}  // namespace cudp
