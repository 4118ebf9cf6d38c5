// cudp's umbrella header: everything a user needs, in one include.
#pragma once

#include "engine/core/device.h"
#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/core/stream.h"
#include "engine/core/tensor.h"
#include "engine/parallel/data_parallel.h"
