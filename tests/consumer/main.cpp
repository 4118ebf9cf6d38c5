// Uses the installed library through the umbrella header and two headers included by name: a CPU
// tensor and its seeded initialiser, a layer's parameter count, a kernel's CPU reference and the
// device count (0 without a GPU).
#include <cstdio>

#include <cudp/cudp.h>
#include <cudp/kernels/elementwise.h>
#include <cudp/layers/linear.h>

int main() {
  cudp::Tensor t = cudp::Tensor::empty({2, 3});
  t.uniform_(0.f, 1.f, 1);
  cudp::Linear fc(3, 4);
  const float x[3] = {-1.f, 0.f, 2.f};
  float y[3] = {};
  cudp::kernels::relu_forward_cpu(x, y, 3);
  std::printf("consumer: %s, Linear(3, 4) has %lld parameters, relu(-1, 0, 2) = (%g, %g, %g), "
              "%d CUDA device(s)\n",
              t.str().c_str(), static_cast<long long>(fc.num_parameters()), y[0], y[1], y[2],
              cudp::cuda::device_count());
  const bool ok = t.numel() == 6 && fc.num_parameters() == 16 && y[0] == 0.f && y[2] == 2.f;
  return ok ? 0 : 1;
}
