// The host side of how cudp launches kernels (engine/core/launch.cuh has launch() itself).
//
// NOTE [Programmatic dependent launch]
// On Hopper and later every kernel of cudp is launched with programmatic stream serialization
// (PDL): the GPU may launch it, and schedule its blocks, while the kernel before it on the stream
// is still running, instead of after that kernel has drained. Each kernel begins with
// kernel_entry() (launch.cuh): griddepcontrol.wait, which holds its threads until every kernel it
// depends on has completed and its memory is visible, before any of its own memory accesses; then
// griddepcontrol.launch_dependents, which lets the next kernel launch in turn. What overlaps is
// therefore the launch latency and block scheduling of kernel i+1 with the tail of kernel
// i (kernel_entry() is the first statement: the kernel's own set-up waits too), never their memory
// accesses: the results are those of a serialised stream, bit for bit. It needs every kernel
// compiled for sm_90 or later (where kernel_entry() has the wait): a build for older
// architectures as well launches ordinarily everywhere (CMakeLists.txt, CUDP_PDL_ARCHITECTURES).
// Within a CUDA graph the captured launches keep these programmatic edges. Launches of other
// libraries (cuBLAS, NCCL, memsets) are ordinary: they wait for our kernels to complete, and ours
// for them. On older GPUs, and when switched off, launches are ordinary too (the wait is then a
// no-op).
#pragma once

namespace cudp::detail {

// Whether launches on the current device use PDL (above): kernels built for sm_90 or later only,
// the switch, and a device of compute capability 9.0 or more (queried once per device).
bool programmatic_launch();
// For comparisons (bench_train --pdl on|off): on by default; affects launches made after the call.
void set_programmatic_launch(bool on);

}  // namespace cudp::detail
