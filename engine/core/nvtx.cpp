#include "engine/core/nvtx.h"

#include <nvtx3/nvToolsExt.h>

namespace cudp::nvtx {

Range::Range(const char* name) { nvtxRangePushA(name); }

Range::~Range() { nvtxRangePop(); }

}  // namespace cudp::nvtx
