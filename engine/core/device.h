#pragma once
// placeholder, replaced below
namespace cudp::cuda { int device_count(); }
