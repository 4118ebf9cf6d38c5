// The MPI session of a test program run under mpirun (tests/parallel/mpi_*_test.cpp): MPI starts
// before the first test and ends after the last, and the tests reach it through mpi_session().
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "engine/parallel/mpi_bootstrap.h"

namespace cudp::testing {

inline parallel::mpi::Session*& mpi_session_slot() {
  static parallel::mpi::Session* session = nullptr;
  return session;
}

// The program's session; null before the environment's SetUp and after its TearDown.
inline parallel::mpi::Session* mpi_session() {
  return mpi_session_slot();
}

class MpiEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    session_ = std::make_unique<parallel::mpi::Session>();
    mpi_session_slot() = session_.get();
  }
  void TearDown() override {
    mpi_session_slot() = nullptr;
    session_.reset();
  }

 private:
  std::unique_ptr<parallel::mpi::Session> session_;
};

// Registers the environment once per program (a test file includes this header once).
[[maybe_unused]] inline auto* const mpi_environment =
    ::testing::AddGlobalTestEnvironment(new MpiEnvironment);

}  // namespace cudp::testing
