// A minimal test harness for plain ctest executables: CHECK-style macros that count failures and
// print where they happened, and a main helper that returns non-zero when anything failed.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>

namespace flashdl_test {

inline int& failures() {
  static int n = 0;
  return n;
}
inline int& checks() {
  static int n = 0;
  return n;
}

// The case being checked, printed with every failure (set by the test loops).
inline std::string& context() {
  static std::string c;
  return c;
}

inline bool report(bool ok, const char* file, int line, const std::string& what) {
  ++checks();
  if (!ok) {
    ++failures();
    if (failures() <= 200)
      std::fprintf(stderr, "FAIL %s:%d: %s%s%s\n", file, line, what.c_str(),
                   context().empty() ? "" : "  [case: ",
                   context().empty() ? "" : (context() + "]").c_str());
  }
  return ok;
}

inline std::string num(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

// Runs one named test function; an escaping exception counts as a failure.
template <typename F>
void run_test(const char* name, F&& fn) {
  const int before = failures();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    fn();
  } catch (const std::exception& e) {
    report(false, __FILE__, __LINE__, std::string("unexpected exception: ") + e.what());
  }
  context().clear();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s %s (%.2f s)\n", failures() == before ? "ok  " : "FAIL", name, secs);
  std::fflush(stdout);
}

inline int finish() {
  std::printf("%d checks, %d failures\n", checks(), failures());
  return failures() == 0 ? 0 : 1;
}

}  // namespace flashdl_test

#define CHECK(cond) ::flashdl_test::report(static_cast<bool>(cond), __FILE__, __LINE__, #cond)

#define CHECK_MSG(cond, msg)                                          \
  ::flashdl_test::report(static_cast<bool>(cond), __FILE__, __LINE__, \
                         std::string(#cond) + ": " + (msg))

#define CHECK_EQ(a, b)                                                                 \
  ::flashdl_test::report((a) == (b), __FILE__, __LINE__,                               \
                         std::string(#a " == " #b " (") + std::to_string(a) + " vs " + \
                             std::to_string(b) + ")")

// |a - b| <= tol, with NaN failing and equal infinities passing.
#define CHECK_NEAR(a, b, tol)                                                                  \
  do {                                                                                         \
    const double ca_ = static_cast<double>(a), cb_ = static_cast<double>(b);                   \
    const bool ok_ = ca_ == cb_ || std::fabs(ca_ - cb_) <= static_cast<double>(tol);           \
    ::flashdl_test::report(ok_, __FILE__, __LINE__,                                            \
                           std::string(#a " ~ " #b ": ") + ::flashdl_test::num(ca_) + " vs " + \
                               ::flashdl_test::num(cb_) + ", tol " +                           \
                               ::flashdl_test::num(static_cast<double>(tol)));                 \
  } while (0)
