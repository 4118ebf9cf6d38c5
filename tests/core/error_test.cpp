#include <gtest/gtest.h>

#include <string>

#include "engine/core/error.h"

namespace cudp {
namespace {

TEST(Error, CudaCheckCarriesLocationCallAndStatusText) {
  try {
    CUDP_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL() << "no exception";
  } catch (const CudaError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("tests/core/error_test.cpp:"), std::string::npos) << what;
    EXPECT_NE(what.find("cudaErrorInvalidValue"), std::string::npos) << what;
    EXPECT_NE(what.find("failed"), std::string::npos) << what;
    EXPECT_EQ(e.code(), cudaErrorInvalidValue);
    EXPECT_GT(e.line(), 0);
  }
}

TEST(Error, TheLocationStartsAtTheProjectsFolderWithoutTheBuildMachinesPath) {
  EXPECT_STREQ(Error("m", "/home/ci/src/data/idx.cpp", 3).what(), "m (at data/idx.cpp:3)");
  EXPECT_STREQ(Error("m", "/home/ci/src/tests/data/idx_test.cpp", 4).what(),
               "m (at tests/data/idx_test.cpp:4)");
  EXPECT_STREQ(Error("m", "/srv/metadata/layers/x.cpp", 5).what(), "m (at layers/x.cpp:5)");
}

TEST(Error, OutOfMemoryIsItsOwnType) {
  EXPECT_THROW(CUDP_CUDA_CHECK(cudaErrorMemoryAllocation), OutOfMemoryError);
}

TEST(Error, CheckThrowsValueErrorWithTheMessage) {
  const int k = 3;
  try {
    CUDP_CHECK(k == 4, "expected 4 channels, got ", k);
    FAIL() << "no exception";
  } catch (const ValueError& e) {
    EXPECT_EQ(e.message(), "expected 4 channels, got 3");
    EXPECT_NE(std::string(e.what()).find("expected 4 channels, got 3"), std::string::npos);
  }
  EXPECT_NO_THROW(CUDP_CHECK(k == 3, "unused"));
}

TEST(Error, EveryErrorIsACudpError) {
  EXPECT_THROW(CUDP_THROW(IoError, "bad file"), Error);
  EXPECT_THROW(CUDP_THROW(LibraryError, "nccl"), Error);
}

}  // namespace
}  // namespace cudp
