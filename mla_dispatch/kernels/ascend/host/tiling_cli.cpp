// Prints the work partition for `tiling_cli NUM_CORES LEN...` as "req begin end slot" lines
// followed by "offsets o0 o1 ...". tests/test_ascend_tiling.py compares it with
// mla_dispatch.metadata.schedule.split_kv_schedule (the partition the emulation uses).
#include "tiling.h"

#include <cstdio>
#include <cstdlib>

int main(int argc, char **argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s NUM_CORES LEN...\n", argv[0]);
        return 2;
    }
    const uint32_t cores = uint32_t(std::strtoul(argv[1], nullptr, 10));
    std::vector<int32_t> lens;
    for (int i = 2; i < argc; ++i) {
        lens.push_back(int32_t(std::strtol(argv[i], nullptr, 10)));
    }
    const auto p = amla::PartitionWork(lens, cores);
    for (const auto &it : p.items) {
        std::printf("%d %d %d %d\n", it.req, it.tokBegin, it.tokEnd, it.slot);
    }
    std::printf("offsets");
    for (int32_t o : p.partOffsets) {
        std::printf(" %d", o);
    }
    std::printf("\n");
    return 0;
}
