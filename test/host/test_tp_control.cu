// The tensor-parallel control plane without a GPU (nanovllm.cu sections 12b and 45): fork, the mailbox, and
// the end of a run on every path. Each case runs a "rank 0" in a child process (tp_launch installs signal
// handlers and an atexit hook, which must not touch this test process), which forks its workers. This
// process is a child subreaper, so a worker whose rank 0 vanished is re-parented here and can be checked.
// What each case asserts: the exit status of rank 0, its message, and that no worker outlives it.
#define NANOVLLM_TESTING
#include "../../nanovllm.cu"
#include "../test.h"

struct RankZero {
  pid_t pid = -1;
  std::vector<pid_t> workers;
  std::string log;  // rank 0's and the workers' stderr
  int status = -1;
};

// Runs body() as rank 0 of an n-rank group in a child process; returns after the child has ended (or after
// `kill_after_s` seconds, when it is killed with SIGKILL first).
static RankZero run_rank_zero(int n, const std::function<void()>& body, double kill_after_s = -1) {
  RankZero rz;
  char path[] = "/tmp/nanovllm_tp_control_XXXXXX";
  int log_fd = mkstemp(path);
  int pipe_fd[2];
  if (log_fd < 0 || pipe(pipe_fd) != 0) die("test set-up failed: %s", strerror(errno));
  fflush(stdout);
  fflush(stderr);
  rz.pid = fork();
  if (rz.pid == 0) {
    close(pipe_fd[0]);
    dup2(log_fd, 2);
    setpgid(0, 0);  // its own process group, like a job in a shell: a group-wide SIGINT stays inside
    tp_launch(n);
    for (int r = 1; r < n; r++) {
      ssize_t w = write(pipe_fd[1], &g_tp.pids[r], sizeof(pid_t));
      (void)w;
    }
    close(pipe_fd[1]);
    body();
    _exit(tp_shutdown() ? 0 : 1);
  }
  close(pipe_fd[1]);
  pid_t w;  // exactly n-1 pids: the workers inherited the pipe too, so it sees no end-of-file before they end
  for (int r = 1; r < n && read(pipe_fd[0], &w, sizeof w) == (ssize_t)sizeof w; r++) rz.workers.push_back(w);
  close(pipe_fd[0]);
  if (kill_after_s >= 0) {
    usleep((useconds_t)(kill_after_s * 1e6));
    kill(rz.pid, SIGKILL);
  }
  waitpid(rz.pid, &rz.status, 0);
  rz.log = read_file(path, "test log");
  close(log_fd);
  unlink(path);
  return rz;
}

// True when pid has exited within `seconds`. A worker re-parented to this process (its rank 0 vanished) is
// reaped here; one that is still someone else's child is looked up with kill(pid, 0).
static bool gone_within(pid_t pid, double seconds) {
  for (double t0 = now_seconds(); now_seconds() - t0 < seconds; usleep(10000)) {
    int st;
    pid_t p = waitpid(pid, &st, WNOHANG);
    if (p == pid) return true;
    if (p < 0 && kill(pid, 0) != 0 && errno == ESRCH) return true;
  }
  return false;
}

// Rank 0 exited with 130 (128 + SIGINT) and its log says `message`.
static void check_interrupted(const RankZero& rz, const char* message) {
  CHECK_MSG(WIFEXITED(rz.status) && WEXITSTATUS(rz.status) == 128 + SIGINT, "rank 0 wait status %d; log:\n%s",
            rz.status, rz.log.c_str());
  CHECK_MSG(rz.log.find(message) != std::string::npos, "no \"%s\" in the log:\n%s", message, rz.log.c_str());
}

static void check_no_worker_left(const RankZero& rz) {
  CHECK_EQ(rz.workers.size() > 0, true);
  for (pid_t w : rz.workers)
    if (!CHECK_MSG(gone_within(w, 5), "worker %d outlived rank 0", (int)w)) kill(w, SIGKILL);  // no hang
}

// Every group size the engine allows beyond 1 (TP_MAX_RANKS = 8), not only the 2 GPUs of the test machine.
TEST(normal_shutdown_ends_every_worker) {
  for (int n = 2; n <= TP_MAX_RANKS; n++) {
    RankZero rz = run_rank_zero(n, [] {});
    CHECK_EQ(rz.workers.size(), (size_t)(n - 1));
    CHECK_MSG(WIFEXITED(rz.status) && WEXITSTATUS(rz.status) == 0, "%d ranks: rank 0 wait status %d; log:\n%s", n,
              rz.status, rz.log.c_str());
    check_no_worker_left(rz);
    CHECK_MSG(rz.log.empty(), "a clean run printed: %s", rz.log.c_str());
  }
}

// A worker that dies (here: rank 0 sends it an engine whose model folder does not exist) ends the whole run:
// its own message, then rank 0's naming the rank, exit status 1, nobody left.
TEST(worker_failure_ends_the_run) {
  RankZero rz = run_rank_zero(3, [] {
    Config c;
    c.model = "/nonexistent/model-folder";
    c.tensor_parallel_size = 3;
    const std::string text = tp_init_payload(c, ModelConfig{});
    tp_send(TPOp::INIT, text.data(), text.size());
    sleep(30);  // rank 0 would now wait for a collective; the SIGCHLD handler must end it first
    _exit(99);
  });
  CHECK_MSG(WIFEXITED(rz.status) && WEXITSTATUS(rz.status) == 1, "rank 0 wait status %d", rz.status);
  CHECK_MSG(rz.log.find("] nanovllm: error: no weights in /nonexistent/model-folder") !=
                std::string::npos,
            "no worker message in:\n%s", rz.log.c_str());
  CHECK_MSG(rz.log.find("nanovllm: error: tensor-parallel rank ") != std::string::npos &&
                rz.log.find("exited with status 1") != std::string::npos,
            "no rank 0 message in:\n%s", rz.log.c_str());
  check_no_worker_left(rz);
}

// Ctrl-C before the engine generates: the terminal sends SIGINT to the whole process group. Workers ignore
// it; rank 0 stops them at once.
TEST(interrupt_ends_every_rank) {
  RankZero rz = run_rank_zero(3, [] {
    usleep(200000);  // let the workers reach their loop (and ignore SIGINT)
    kill(0, SIGINT);
    sleep(30);
    _exit(99);
  });
  check_interrupted(rz, "\nnanovllm: interrupted; stopping all 3 ranks\n");  // a line of its own
  check_no_worker_left(rz);
}

// Ctrl-C while the engine generates (g_stop_armed): rank 0 only notes it, finishes its step and ends the run
// the normal way (EXIT to the workers, who exit 0), then exits 130. Here the "step" is a wait for the flag.
static void graceful_body() {
  g_stop_armed = 1;
  usleep(200000);
  kill(0, SIGINT);
  for (int i = 0; i < 500 && !g_stop_requested; i++) usleep(10000);
  bool ok = tp_shutdown();
  _exit(!ok ? 1 : g_stop_requested ? 128 + SIGINT : 99);
}

TEST(interrupt_while_generating_ends_the_run_normally) {
  RankZero rz = run_rank_zero(8, graceful_body);
  check_interrupted(rz, "interrupted: stopping after this step");
  CHECK_MSG(rz.log.find("stopping all") == std::string::npos, "workers were killed, not ended:\n%s",
            rz.log.c_str());
  check_no_worker_left(rz);
}

// A second Ctrl-C does not wait for the step: every rank is stopped at once.
TEST(second_interrupt_stops_at_once) {
  RankZero rz = run_rank_zero(3, [] {
    g_stop_armed = 1;
    usleep(200000);
    kill(0, SIGINT);
    usleep(100000);
    kill(0, SIGINT);
    sleep(30);
    _exit(99);
  });
  check_interrupted(rz, "\nnanovllm: interrupted; stopping all 3 ranks\n");  // a line of its own
  check_no_worker_left(rz);
}

// One GPU, no workers: the same two behaviours from the handlers main() installs.
TEST(interrupt_single_process) {
  RankZero rz = run_rank_zero(1, [] {
    install_stop_handlers();
    graceful_body();
  });
  check_interrupted(rz, "interrupted: stopping after this step");
  rz = run_rank_zero(1, [] {
    install_stop_handlers();  // not armed: the engine is not generating yet, so Ctrl-C stops at once
    kill(0, SIGINT);
    sleep(30);
    _exit(99);
  });
  check_interrupted(rz, "nanovllm: interrupted\n");
}

// An error on rank 0 (die -> exit(1)) takes the workers down through the atexit hook.
TEST(rank_zero_error_ends_every_worker) {
  RankZero rz = run_rank_zero(2, [] { die("something the user must fix"); });
  CHECK_MSG(WIFEXITED(rz.status) && WEXITSTATUS(rz.status) == 1, "rank 0 wait status %d", rz.status);
  CHECK(rz.log.find("nanovllm: error: something the user must fix") != std::string::npos);
  check_no_worker_left(rz);
}

// The workers serve only the engine rank 0 built last: a step of an older one is refused with a message (it
// would run on the newer engine's block tables), and every rank ends.
TEST(stale_engine_is_refused) {
  RankZero rz = run_rank_zero(2, [] {
    g_tp.engines = 2;  // as after two engines were built
    tp_send_step(1, TPStep{}, nullptr);
  });
  CHECK_MSG(WIFEXITED(rz.status) && WEXITSTATUS(rz.status) == 1, "rank 0 wait status %d", rz.status);
  CHECK_MSG(rz.log.find("this engine (number 1) can no longer run with tensor parallelism") != std::string::npos,
            "log:\n%s", rz.log.c_str());
  check_no_worker_left(rz);
}

// Rank 0 killed outright (no handler, no atexit): PR_SET_PDEATHSIG ends the workers, with their message.
TEST(rank_zero_killed_ends_every_worker) {
  RankZero rz = run_rank_zero(3, [] { sleep(30); }, 0.5);
  CHECK(WIFSIGNALED(rz.status) && WTERMSIG(rz.status) == SIGKILL);
  check_no_worker_left(rz);
}

int main(int argc, char** argv) {
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  return test_main(argc, argv);
}
