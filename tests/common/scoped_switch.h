// The library's process-wide switches (kernels::detail::set_conv_swapped, set_splitk_in_kernel,
// set_deferred_bias_grads, ...) set for a test's scope and put back as they were found, however the
// scope ends, so that a failing test does not change the ones after it.
#pragma once

namespace cudp::testing {

template <typename T>
class ScopedSwitch {
 public:
  ScopedSwitch(T (*get)(), void (*set)(T), T value) : set_(set), before_(get()) { set(value); }
  ScopedSwitch(const ScopedSwitch&) = delete;
  ScopedSwitch& operator=(const ScopedSwitch&) = delete;
  ~ScopedSwitch() { set_(before_); }

 private:
  void (*set_)(T);
  T before_;
};

}  // namespace cudp::testing
