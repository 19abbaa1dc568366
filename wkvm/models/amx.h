// What the int8 and int4 kernels' AMX paths share: whether this process may use the tiles, the tile configuration
// record, and a thread's scratch bytes. Defines WKVM_AMX where the compiler knows the instructions (GCC 11, Clang 12)
// and the OS is Linux (whose kernel must grant each process the tiles' state).
// int8.load_kernel hashes the headers a source includes with quotes: editing this file rebuilds its users.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__) && defined(__has_include)
#if __has_include(<amxtileintrin.h>)
#define WKVM_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace wkvm::amx {
namespace {  // internal linkage: each library that includes this keeps its own copy

// whether this CPU has AMX-INT8 and Linux lets this process use its tiles (asked once: ARCH_REQ_XCOMP_PERM for
// XTILEDATA, which every thread of the process then has)
inline bool usable() {
#ifdef WKVM_AMX
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

constexpr int64_t TILE_ROWS = 16;  // rows of x per tile, at most
// Fewer rows of x go to the VNNI loop: each group's sums leave the tiles through memory, and a group's tile loads,
// products and stores cost about what VNNI's products of 8 rows do. int8 against VNNI (one thread, Intel Xeon with
// AMX, best of 7): 0.99-1.18x at 16 and 24 rows, 1.27-1.29x at 32, 1.36-1.47x at 48, 1.38-1.51x at 64, 1.54-1.74x at
// 512 (576 x 1,536 and 1,536 x 576 in L2, 3,072 x 576 from memory); int4 1.14-1.26x at 32, 1.30-1.40x at 512.
constexpr int64_t AMX_ROWS = 32;

// ldtilecfg's 64-byte record (palette 1)
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int64_t rows_, int64_t bytes) {
    rows[tile] = static_cast<uint8_t>(rows_);
    colsb[tile] = static_cast<uint16_t>(bytes);
  }
};

// n bytes of this thread's scratch, 64-byte aligned, kept between calls (a decode step calls a kernel ~200 times)
inline int8_t* scratch(size_t n) {
  static thread_local std::vector<int8_t> bytes;
  if (bytes.size() < n + 64) bytes.resize(n + 64);
  return reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(bytes.data()) + 63) & ~uintptr_t(63));
}

}  // namespace
}  // namespace wkvm::amx
