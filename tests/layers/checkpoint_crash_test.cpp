// Crash tests of checkpoints: a process saving in a loop is killed (SIGKILL) at every step of a
// save and at random moments, a save fails on a file-size limit (the disk-full case), and a save's
// fsync or rename fails (an injected EIO, engine/core/file.h's test hook); every time, the
// checkpoint loads, and it is the last save that completed or the one in flight, never a mix of
// two, and no temporary file outlives the next save.
//
// The truth each check compares against is kept outside the checkpoint: save i writes weights that
// all equal i, momentum buffers that all equal i + 0.5 and metadata step=i, and the child reports
// over a pipe each save that returned. A load must find one i in all three places, with i the last
// reported save or the next one.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/file.h"
#include "layers/checkpoint.h"
#include "layers/linear.h"
#include "layers/sequential.h"
#include "layers/temp_dir.h"

namespace cudp {
namespace {

using testing::TempDir;

// Two Linear layers: 2 x (64 x 64 + 64) floats, about 33 KB a file, so a save takes long enough for
// a random kill to land inside it.
struct Trainee {
  std::shared_ptr<Sequential> model = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Linear>(64, 64, true, 1), std::make_shared<Linear>(64, 64, true, 2)});
  SGD sgd{model->parameters(), {.lr = 0.1, .momentum = 0.9}};

  Trainee() {
    // One step makes the momentum buffers exist, so the training-state file holds tensors.
    for (Parameter* p : model->parameters()) p->grad.fill_(1.0f);
    sgd.step();
  }

  // Save i: every weight i, every momentum buffer i + 0.5.
  void save(const std::string& path, int i, bool with_optimizer = true) {
    set_state(i);
    save_checkpoint(path, *model, with_optimizer ? &sgd : nullptr, {{"step", std::to_string(i)}});
  }

  // Save i to every one of `paths` (the first written, the others hard-linked to it).
  void save_to(const std::vector<std::string>& paths, int i) {
    set_state(i);
    write_checkpoints(paths, snapshot_checkpoint(*model, &sgd, {{"step", std::to_string(i)}}));
  }

  void set_state(int i) {
    for (Parameter* p : model->parameters()) p->data.fill_(static_cast<float>(i));
    TensorMap state = sgd.state_dict(names());
    for (auto& [name, t] : state) t.fill_(static_cast<float>(i) + 0.5f);
    sgd.load_state_dict(state, names());
  }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, p] : model->named_parameters()) out.push_back(name);
    return out;
  }
};

// Loads `path` into a fresh model and optimizer and returns the save's number, after checking that
// weights, momentum and metadata all name the same save.
int load_and_check(const std::string& path, bool with_optimizer = true) {
  Trainee fresh;
  const Metadata meta = load_checkpoint(path, *fresh.model, with_optimizer ? &fresh.sgd : nullptr);
  const int step = std::stoi(meta.at("step"));
  for (const auto& [name, t] : fresh.model->state_dict()) {
    for (float v : t.to_vector<float>()) {
      EXPECT_EQ(v, static_cast<float>(step)) << name << " in the save of step " << step;
    }
  }
  if (with_optimizer) {
    for (const auto& [name, t] : fresh.sgd.state_dict(fresh.names())) {
      for (float v : t.to_vector<float>()) {
        EXPECT_EQ(v, static_cast<float>(step) + 0.5f) << name << " in the save of step " << step;
      }
    }
  }
  return step;
}

int temporaries(const TempDir& dir) {
  int n = 0;
  for (const std::string& name : dir.entries()) n += name.find(".tmp-") != std::string::npos;
  return n;
}

// How a saver saves step i: Trainee::save to one path, or save_to several.
using SaveStep = std::function<void(Trainee&, int)>;

// A child process that saves steps first, first + 1, ... and writes each finished step's number to
// `ack_fd`; `hook` (if any) runs at every step of every save.
[[noreturn]] void run_saver(const SaveStep& save, int first, int ack_fd,
                            void (*hook)(const char*)) {
  Trainee t;
  detail::set_checkpoint_fault_hook(hook);
  for (int i = first;; ++i) {
    save(t, i);
    if (::write(ack_fd, &i, sizeof i) != sizeof i) ::_exit(3);
  }
}

// The last step the child reported, or -1.
int last_ack(int fd) {
  int last = -1, step = 0;
  while (::read(fd, &step, sizeof step) == sizeof step) last = step;
  return last;
}

// The fault hook's target, set before fork: the child kills itself at the stage named
// `g_kill_stage` of the save after `g_kill_after` completed ones.
const char* g_kill_stage = nullptr;
int g_kill_after = 0;
int g_saves_done = 0;

void kill_at_stage(const char* stage) {
  if (std::strcmp(stage, "published model") == 0) ++g_saves_done;
  if (g_saves_done == g_kill_after + (std::strcmp(stage, "published model") == 0) &&
      std::strcmp(stage, g_kill_stage) == 0) {
    ::raise(SIGKILL);
  }
}

struct Child {
  pid_t pid;
  int ack_fd;
};

Child start_saver(const SaveStep& save, int first, void (*hook)(const char*)) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    run_saver(save, first, fds[1], hook);
  }
  ::close(fds[1]);
  return {pid, fds[0]};
}

Child start_saver(const std::string& path, int first, void (*hook)(const char*)) {
  return start_saver([&path](Trainee& t, int i) { t.save(path, i); }, first, hook);
}

Child start_linked_saver(const std::vector<std::string>& paths, int first,
                         void (*hook)(const char*)) {
  return start_saver([&paths](Trainee& t, int i) { t.save_to(paths, i); }, first, hook);
}

// Waits for the child to die of SIGKILL and returns the last step it finished.
int reap(const Child& child) {
  int status = 0;
  EXPECT_EQ(::waitpid(child.pid, &status, 0), child.pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << "the saver did not die of SIGKILL (status " << status << ")";
  const int last = last_ack(child.ack_fd);
  ::close(child.ack_fd);
  return last;
}

const char* const kStages[] = {"staged", "moved training state", "moved model",
                               "published training state", "published model"};

// Temporaries a save killed at `stage` leaves: both files until the training state is published.
int temporaries_left_at(const std::string& stage) {
  return stage == "published model" ? 0 : stage == "published training state" ? 1 : 2;
}

TEST(CheckpointKill, EveryStepOfASaveLeavesTheLastCompleteCheckpoint) {
  int kills = 0;
  for (int completed = 0; completed <= 2; ++completed) {  // no earlier save, one, two
    for (const std::string stage : kStages) {
      // The first save has no earlier checkpoint to move.
      if (completed == 0 && stage.rfind("moved", 0) == 0) continue;
      SCOPED_TRACE(::testing::Message() << "killed at '" << stage << "' after " << completed
                                        << " complete saves");
      TempDir dir;
      const std::string path = dir.file("run.safetensors");
      g_kill_stage = stage.c_str();
      g_kill_after = completed;
      g_saves_done = 0;
      const Child child = start_saver(path, 0, kill_at_stage);
      const int last = reap(child);
      ++kills;
      ASSERT_EQ(last, completed - 1);  // the save in flight never returned
      // Killed after its last rename, the save in flight is complete; before, the previous one is.
      const int expected = stage == "published model" ? completed : completed - 1;
      if (expected < 0) {
        EXPECT_THROW(find_checkpoint(path), IoError);  // nothing was ever complete
      } else {
        EXPECT_EQ(load_and_check(path), expected);
        const bool torn = stage != "staged" && stage != "published model";
        EXPECT_EQ(find_checkpoint(path).fallback, torn);
      }
      // The next save after the crash succeeds, removes the dead process's temporaries, and what
      // it wrote loads.
      EXPECT_EQ(temporaries(dir), temporaries_left_at(stage));
      Trainee t;
      t.save(path, 100);
      EXPECT_EQ(temporaries(dir), 0) << ::testing::PrintToString(dir.entries());
      EXPECT_EQ(load_and_check(path), 100);
      EXPECT_FALSE(find_checkpoint(path).fallback);
    }
  }
  EXPECT_EQ(kills, 13);
}

// Files a save set aside (the .prev pairs it replaced, ".old-"), which only a kill leaves behind.
int set_aside(const TempDir& dir) {
  int n = 0;
  for (const std::string& name : dir.entries()) n += name.find(".old-") != std::string::npos;
  return n;
}

// The kill of a save to two paths (the second's files hard links to the first's): the child dies
// at stage g_kill_stage of target g_kill_target (0: written, 1: linked) of the save after
// g_kill_after complete ones.
int g_kill_target = 0;
int g_published = 0;  // "published model" so far: two a save

void kill_at_linked_stage(const char* stage) {
  const int save = g_published / 2, target = g_published % 2;
  if (std::strcmp(stage, "published model") == 0) ++g_published;
  if (save == g_kill_after && target == g_kill_target && std::strcmp(stage, g_kill_stage) == 0) {
    ::raise(SIGKILL);
  }
}

// A save to two paths killed at every step of each path's part: each path loads its last complete
// save (the one in flight once that path's model is published, the previous one before), the
// second path's files are the first's wherever both hold the same save, and the next save removes
// every temporary and set-aside file the dead process left, in both paths' names.
TEST(CheckpointKill, EveryStepOfALinkedSaveLeavesTheLastCompleteCheckpoint) {
  const char* const stages[] = {"staged",      "moved previous save aside", "moved training state",
                                "moved model", "published training state",  "published model"};
  int kills = 0;
  for (int completed = 0; completed <= 2; ++completed) {
    for (int target = 0; target < 2; ++target) {
      for (const std::string stage : stages) {
        // The first save has no earlier checkpoint to move.
        if (completed == 0 && stage.rfind("moved", 0) == 0) continue;
        SCOPED_TRACE(::testing::Message() << "killed at '" << stage << "' of path " << target
                                          << " after " << completed << " complete saves");
        TempDir dir;
        const std::vector<std::string> paths = {dir.file("last.safetensors"),
                                                dir.file("best.safetensors")};
        g_kill_stage = stage.c_str();
        g_kill_after = completed;
        g_kill_target = target;
        g_published = 0;
        const Child child = start_linked_saver(paths, 0, kill_at_linked_stage);
        const int last = reap(child);
        ++kills;
        ASSERT_EQ(last, completed - 1);
        const bool in_flight_done = stage == "published model";
        for (int p = 0; p < 2; ++p) {
          SCOPED_TRACE(paths[p]);
          // Paths before the one killed hold the save in flight; the one killed holds it once its
          // model is published; the ones after it, the previous save.
          const int expected =
              p < target || (p == target && in_flight_done) ? completed : completed - 1;
          if (expected < 0) {
            EXPECT_THROW(find_checkpoint(paths[p]), IoError);
          } else {
            EXPECT_EQ(load_and_check(paths[p]), expected);
          }
        }
        if (target == 1 && in_flight_done) {
          EXPECT_TRUE(std::filesystem::equivalent(paths[0], paths[1]));
        }
        // Set aside until the save's end: the .prev pair of each path the save got past "staged"
        // in, when it had one.
        const int paths_set_aside = completed >= 2 ? target + (stage != "staged") : 0;
        EXPECT_EQ(set_aside(dir), 2 * paths_set_aside) << ::testing::PrintToString(dir.entries());
        EXPECT_EQ(temporaries(dir), temporaries_left_at(stage));
        Trainee t;
        t.save_to(paths, 100);
        EXPECT_EQ(temporaries(dir) + set_aside(dir), 0) << ::testing::PrintToString(dir.entries());
        for (const std::string& path : paths) {
          EXPECT_EQ(load_and_check(path), 100);
          EXPECT_FALSE(find_checkpoint(path).fallback);
        }
        EXPECT_TRUE(std::filesystem::equivalent(paths[0], paths[1]));
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
  EXPECT_EQ(kills, 2 * (3 + 6 + 6));
}

// Random kills of a process saving to two paths: each path loads either the save it held before
// (or the last one the process reported, which both paths hold) or the one the process was in, and
// the second path is never newer than the first.
TEST(CheckpointKill, RandomKillsOfALinkedSaveLeaveTheLastOrTheNextSave) {
  TempDir dir;
  const std::vector<std::string> paths = {dir.file("last.safetensors"),
                                          dir.file("best.safetensors")};
  std::mt19937 rng(54321);
  int next = 0, apart = 0;
  int known[2] = {-1, -1};  // what each path held after the last kill
  const int kIterations = 100;
  for (int iteration = 0; iteration < kIterations; ++iteration) {
    const Child child = start_linked_saver(paths, next, nullptr);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
    ::kill(child.pid, SIGKILL);
    const int last = reap(child);
    SCOPED_TRACE(::testing::Message() << "iteration " << iteration << ", last reported save "
                                      << last << ", first of this child " << next);
    if (last < 0 && next == 0) {  // killed before anything was complete at both paths
      if (::testing::Test::HasFailure()) break;
      continue;
    }
    const int in_flight = last >= 0 ? last + 1 : next;
    int steps[2];
    for (int p = 0; p < 2; ++p) {
      const int held = last >= 0 ? last : known[p];
      steps[p] = load_and_check(paths[p]);
      EXPECT_TRUE(steps[p] == held || steps[p] == in_flight)
          << paths[p] << ": loaded step " << steps[p] << ", expected " << held << " or "
          << in_flight;
      known[p] = steps[p];
    }
    EXPECT_LE(steps[1], steps[0]);
    apart += steps[0] != steps[1];
    next = steps[0] + 1;
    if (::testing::Test::HasFailure()) break;
  }
  std::printf("%d random kills of a two-path save: %d left the paths at different saves\n",
              kIterations, apart);
  Trainee t;
  t.save_to(paths, next);
  EXPECT_EQ(temporaries(dir) + set_aside(dir), 0) << ::testing::PrintToString(dir.entries());
  for (const std::string& path : paths) EXPECT_EQ(load_and_check(path), next);
}

TEST(CheckpointKill, RandomKillsAlwaysLeaveTheLastOrTheNextSave) {
  TempDir dir;
  const std::string path = dir.file("run.safetensors");
  std::mt19937 rng(12345);
  int next = 0, fallbacks = 0, advanced = 0;
  const int kIterations = 200;
  for (int iteration = 0; iteration < kIterations; ++iteration) {
    const Child child = start_saver(path, next, nullptr);
    // Kill after a random wait: some kills land between saves, some inside one.
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
    ::kill(child.pid, SIGKILL);
    const int last = reap(child);
    SCOPED_TRACE(::testing::Message() << "iteration " << iteration << ", last reported save "
                                      << last << ", first of this child " << next);
    if (last < 0 && next == 0) {  // killed before anything was complete
      if (::testing::Test::HasFailure()) break;
      continue;
    }
    const int before = last >= 0 ? last : next - 1;  // the last save known to be complete
    fallbacks += find_checkpoint(path).fallback;
    const int step = load_and_check(path);
    EXPECT_TRUE(step == before || step == before + 1)
        << "loaded step " << step << ", expected " << before << " or " << before + 1;
    advanced += step == before + 1;
    next = std::max(step, before) + 1;
    if (::testing::Test::HasFailure()) break;
  }
  std::printf("%d random kills: %d loaded a save the child had not reported, %d fell back to the "
              "previous save\n",
              kIterations, advanced, fallbacks);
  Trainee t;
  t.save(path, next);
  EXPECT_EQ(temporaries(dir), 0) << ::testing::PrintToString(dir.entries());
  EXPECT_EQ(load_and_check(path), next);
}

// Sets the file-size limit of this process (RLIMIT_FSIZE) and ignores SIGXFSZ, so a write beyond
// the limit fails with EFBIG as a write to a full disk fails with ENOSPC; restores both at the end.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit = saved_;
    limit.rlim_cur = bytes;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    ::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit saved_{};
  void (*old_handler_)(int) = nullptr;
};

TEST(CheckpointDiskFull, AFailedWriteLeavesThePreviousCheckpointWhole) {
  for (const bool with_optimizer : {true, false}) {
    TempDir dir;
    const std::string path = dir.file("run.safetensors");
    Trainee t;
    t.save(path, 1, with_optimizer);
    t.save(path, 2, with_optimizer);
    const uint64_t train_bytes = std::filesystem::file_size(optimizer_state_path(path));
    const uint64_t model_bytes = std::filesystem::file_size(path);
    // Limits inside the first file, at its end, and inside the second (the training state is
    // written first; without an optimizer it is small and the model file fails alone).
    std::vector<uint64_t> limits = {0, 7, 8, 100, train_bytes - 1};
    if (model_bytes > train_bytes) limits.insert(limits.end(), {train_bytes, model_bytes - 1});
    for (const uint64_t limit : limits) {
      SCOPED_TRACE(::testing::Message() << "file-size limit " << limit << " bytes, optimizer "
                                        << with_optimizer);
      {
        FileSizeLimit guard(limit);
        try {
          t.save(path, 3, with_optimizer);
          ADD_FAILURE() << "the save succeeded past the file-size limit";
        } catch (const IoError& e) {
          const std::string what = e.what();
          EXPECT_NE(what.find(std::strerror(EFBIG)), std::string::npos) << what;
          EXPECT_NE(what.find("run."), std::string::npos) << what;
        }
      }
      EXPECT_EQ(load_and_check(path, with_optimizer), 2);
      EXPECT_FALSE(find_checkpoint(path).fallback);
      EXPECT_EQ(temporaries(dir), 0) << ::testing::PrintToString(dir.entries());
    }
    t.save(path, 3, with_optimizer);  // with room again, the next save goes through
    EXPECT_EQ(load_and_check(path, with_optimizer), 3);
    EXPECT_EQ(load_and_check(previous_checkpoint_path(path), with_optimizer), 2);
  }
}

// The file fault hook's (engine/core/file.h) state: every fsync and rename of a save is recorded,
// and the one numbered g_fail_call (from 0; -1: none) fails with EIO without being made.
std::vector<std::string> g_file_calls;
int g_fail_call = -1;

int fail_one_call(const char* operation, const std::string& /*path*/) {
  g_file_calls.emplace_back(operation);
  return static_cast<int>(g_file_calls.size()) - 1 == g_fail_call ? EIO : 0;
}

// Saves 1 and 2 in `dir`, then save 3 with call `fail_call` of its fsyncs and renames failing (-1:
// none). Returns the calls save 3 made, up to the failing one; `what` gets the error.
std::vector<std::string> save_with_failing_call(const TempDir& dir, int fail_call, bool optimizer,
                                                std::string& what) {
  const std::string path = dir.file("run.safetensors");
  Trainee t;
  t.save(path, 1, optimizer);
  t.save(path, 2, optimizer);
  g_file_calls.clear();
  g_fail_call = fail_call;
  detail::set_file_fault_hook(fail_one_call);
  try {
    t.save(path, 3, optimizer);
  } catch (const IoError& e) {
    what = e.what();
  }
  detail::set_file_fault_hook(nullptr);
  return g_file_calls;
}

// A save whose fsync (of a file or of the directory) or rename fails, at each one in turn: the save
// throws an IoError with the system's error, no temporary file stays, and the checkpoint loads the
// last complete save: the previous one, or the new one when only the directory's fsync after the
// last rename failed (the save had replaced both files). The next save goes through and keeps that
// one as its previous.
TEST(CheckpointIoFailure, AFailingFsyncOrRenameLeavesTheLastCompleteCheckpoint) {
  for (const bool optimizer : {true, false}) {
    std::vector<std::string> calls;
    {
      TempDir dir;
      std::string what;
      calls = save_with_failing_call(dir, -1, optimizer, what);
      EXPECT_EQ(what, "");
      EXPECT_EQ(load_and_check(dir.file("run.safetensors"), optimizer), 3);
    }
    // Both files fsync'ed, four renames (two to the .prev names, two into place), each followed by
    // the directory's fsync.
    ASSERT_EQ(std::count(calls.begin(), calls.end(), "fsync"), 2)
        << ::testing::PrintToString(calls);
    ASSERT_EQ(std::count(calls.begin(), calls.end(), "rename"), 4);
    ASSERT_EQ(std::count(calls.begin(), calls.end(), "fsync directory"), 4);
    const int first_rename =
        static_cast<int>(std::find(calls.begin(), calls.end(), "rename") - calls.begin());
    const int last_rename = static_cast<int>(calls.rend() - std::find(calls.rbegin(), calls.rend(),
                                                                      std::string("rename"))) -
                            1;
    // The fallback to the .prev names (and its warning) is expected while the pair at `path` is
    // torn: after the first move and until the last rename has been made.
    detail::set_checkpoint_warning_handler([](const std::string&) {});
    for (int k = 0; k < static_cast<int>(calls.size()); ++k) {
      SCOPED_TRACE(::testing::Message()
                   << "call " << k << " (" << calls[k] << ") fails, optimizer " << optimizer);
      TempDir dir;
      const std::string path = dir.file("run.safetensors");
      std::string what;
      const std::vector<std::string> made = save_with_failing_call(dir, k, optimizer, what);
      EXPECT_EQ(made.size(), static_cast<size_t>(k) + 1) << "a save went on after a failed call";
      EXPECT_NE(what.find(std::strerror(EIO)), std::string::npos) << what;
      EXPECT_NE(what.find(calls[k] == "rename" ? "rename" : "fsync"), std::string::npos) << what;
      EXPECT_EQ(temporaries(dir), 0) << ::testing::PrintToString(dir.entries());
      const int expected = k > last_rename ? 3 : 2;
      EXPECT_EQ(find_checkpoint(path).fallback, k > first_rename && k <= last_rename);
      EXPECT_EQ(load_and_check(path, optimizer), expected);
      Trainee t;
      t.save(path, 4, optimizer);
      EXPECT_EQ(temporaries(dir), 0) << ::testing::PrintToString(dir.entries());
      EXPECT_EQ(load_and_check(path, optimizer), 4);
      EXPECT_EQ(load_and_check(previous_checkpoint_path(path), optimizer), expected);
    }
    detail::set_checkpoint_warning_handler(nullptr);
  }
}

// A save to two paths (the second hard-linked to the first) with each of its fsyncs, renames and
// links failing in turn (EIO): the save throws, no temporary or set-aside file remains, and each
// path loads its last complete save: the new one where the failure came after that path's last
// rename, the one before otherwise. Where the failure was a path's first move to the .prev names,
// the .prev pair it had set aside is back. The next save goes through at both paths.
TEST(CheckpointIoFailure, AFailingCallOfALinkedSaveLeavesEachPathsLastCompleteCheckpoint) {
  const auto save_with_failing_call = [](const std::vector<std::string>& paths, int fail_call,
                                         std::string& what) {
    Trainee t;
    t.save_to(paths, 1);
    t.save_to(paths, 2);
    g_file_calls.clear();
    g_fail_call = fail_call;
    detail::set_file_fault_hook(fail_one_call);
    try {
      t.save_to(paths, 3);
    } catch (const IoError& e) {
      what = e.what();
    }
    detail::set_file_fault_hook(nullptr);
    return g_file_calls;
  };
  std::vector<std::string> calls;
  {
    TempDir dir;
    std::string what;
    calls =
        save_with_failing_call({dir.file("a.safetensors"), dir.file("b.safetensors")}, -1, what);
    EXPECT_EQ(what, "");
  }
  // The first path: 2 fsyncs and 4 renames; the second: 2 links, each fsync'ed, and 4 renames;
  // every rename followed by the directory's fsync.
  ASSERT_EQ(std::count(calls.begin(), calls.end(), "link"), 2) << ::testing::PrintToString(calls);
  ASSERT_EQ(std::count(calls.begin(), calls.end(), "fsync"), 4);
  ASSERT_EQ(std::count(calls.begin(), calls.end(), "rename"), 8);
  ASSERT_EQ(std::count(calls.begin(), calls.end(), "fsync directory"), 8);
  std::vector<int> renames;
  for (int k = 0; k < static_cast<int>(calls.size()); ++k) {
    if (calls[k] == "rename") renames.push_back(k);
  }
  detail::set_checkpoint_warning_handler([](const std::string&) {});
  for (int k = 0; k < static_cast<int>(calls.size()); ++k) {
    SCOPED_TRACE(::testing::Message() << "call " << k << " (" << calls[k] << ") fails");
    TempDir dir;
    const std::vector<std::string> paths = {dir.file("a.safetensors"), dir.file("b.safetensors")};
    std::string what;
    const std::vector<std::string> made = save_with_failing_call(paths, k, what);
    EXPECT_EQ(made.size(), static_cast<size_t>(k) + 1) << "a save went on after a failed call";
    EXPECT_NE(what.find(std::strerror(EIO)), std::string::npos) << what;
    EXPECT_EQ(temporaries(dir) + set_aside(dir), 0) << ::testing::PrintToString(dir.entries());
    int expected[2];
    for (int p = 0; p < 2; ++p) {
      expected[p] = k > renames[4 * p + 3] ? 3 : 2;
      EXPECT_EQ(load_and_check(paths[p]), expected[p]) << paths[p];
      if (k == renames[4 * p]) {  // its first move failed: its .prev pair went back
        EXPECT_EQ(load_and_check(previous_checkpoint_path(paths[p])), 1) << paths[p];
        EXPECT_FALSE(find_checkpoint(paths[p]).fallback);
      }
    }
    Trainee t;
    t.save_to(paths, 4);
    EXPECT_EQ(temporaries(dir) + set_aside(dir), 0) << ::testing::PrintToString(dir.entries());
    for (int p = 0; p < 2; ++p) {
      EXPECT_EQ(load_and_check(paths[p]), 4);
      EXPECT_EQ(load_and_check(previous_checkpoint_path(paths[p])), expected[p]);
    }
    EXPECT_TRUE(std::filesystem::equivalent(paths[0], paths[1]));
  }
  detail::set_checkpoint_warning_handler(nullptr);
}

TEST(CheckpointStaleTemporaries, OnlyThoseOfDeadProcessesAreRemoved) {
  TempDir dir;
  const std::string path = dir.file("run.safetensors");
  // A process that has exited: its pid is free (unless reused at once, which the check tolerates).
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string stale = dir.file(".run.safetensors.tmp-" + std::to_string(dead) + "-0");
  const std::string live = dir.file(".run.safetensors.tmp-" + std::to_string(::getppid()) + "-0");
  const std::string other = dir.file(".other.safetensors.tmp-" + std::to_string(dead) + "-0");
  for (const std::string& f : {stale, live, other}) ::close(::open(f.c_str(), O_CREAT | O_WRONLY, 0600));
  Trainee t;
  t.save(path, 1);
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_TRUE(std::filesystem::exists(live));   // a running process may still be writing it
  EXPECT_TRUE(std::filesystem::exists(other));  // another file's
}

}  // namespace
}  // namespace cudp
