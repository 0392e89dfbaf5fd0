// A small C++ program that allocates through operator new, for the native fault shim
// (faults/native.py builds it with g++ and runs it under LD_PRELOAD=shim).
//
// usage: new_demo --catch|--no-catch NTH [COUNT]
//   Arms the preloaded shim (faultshim_arm, found with dlsym) to fail allocation NTH, then makes
//   COUNT (default 16) allocations with new[], one malloc each. With --catch a
//   std::bad_alloc is caught and printed ("caught std::bad_alloc ..."), exit 0. With --no-catch it
//   escapes main, std::terminate aborts the process: SIGABRT, as upstream's server loop would.
//   Without a fault it prints "completed COUNT allocations". Exit 2 when the shim is not preloaded.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

using arm_fn = void (*)(long, int);
using disarm_fn = long (*)();

std::vector<unsigned char *> g_entries;

// exactly one operator new (one malloc) per iteration: the reserve() in main keeps push_back quiet
void build_entries(int count) {
    for (int i = 0; i < count; ++i) {
        g_entries.push_back(new unsigned char[4096 + static_cast<size_t>(i)]);
    }
}

int main(int argc, char **argv) {
    if (argc < 3 || (std::strcmp(argv[1], "--catch") != 0 && std::strcmp(argv[1], "--no-catch") != 0)) {
        std::fprintf(stderr, "usage: new_demo --catch|--no-catch NTH [COUNT]\n");
        return 2;
    }
    const bool do_catch = std::strcmp(argv[1], "--catch") == 0;
    const long nth = std::strtol(argv[2], nullptr, 10);
    const int count = argc > 3 ? std::atoi(argv[3]) : 16;
    auto arm = reinterpret_cast<arm_fn>(dlsym(RTLD_DEFAULT, "faultshim_arm"));
    auto disarm = reinterpret_cast<disarm_fn>(dlsym(RTLD_DEFAULT, "faultshim_disarm"));
    if (arm == nullptr || disarm == nullptr) {
        std::fprintf(stderr, "new_demo: the fault shim is not preloaded (LD_PRELOAD)\n");
        return 2;
    }
    g_entries.reserve(static_cast<size_t>(count));
    arm(nth, 0);
    if (do_catch) {
        try {
            build_entries(count);
        } catch (const std::bad_alloc &e) {
            const long fired = disarm();
            std::printf("caught std::bad_alloc: %s at allocation #%zu (%ld fault fired)\n", e.what(),
                        g_entries.size() + 1, fired);
            return 0;
        }
    } else {
        build_entries(count);  // a bad_alloc here has no handler: std::terminate -> abort()
    }
    const long fired = disarm();
    std::printf("completed %d allocations (%ld fault fired)\n", count, fired);
    for (auto *p : g_entries) delete[] p;
    return 0;
}
