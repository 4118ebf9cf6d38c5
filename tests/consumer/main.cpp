// Uses the installed library: a CPU tensor, its seeded initialiser and the device count.
#include <cstdio>

#include <cudp/cudp.h>

int main() {
  cudp::Tensor t = cudp::Tensor::empty({2, 3});
  t.uniform_(0.f, 1.f, 1);
  std::printf("consumer: %s, %d CUDA device(s)\n", t.str().c_str(), cudp::cuda::device_count());
  return t.numel() == 6 ? 0 : 1;
}
